#pragma once
#include "checkpoint/state_dict.h"  // moved to checkpoint/state_dict.h
