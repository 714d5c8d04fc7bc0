#pragma once
#include "checkpoint/optimizer_state_dict.h"  // moved to checkpoint/optimizer_state_dict.h
