#pragma once
#include "fsdp_cpp/checkpoint/state_dict.h"  // moved to checkpoint/state_dict.h
