#pragma once
#include "fsdp_cpp/checkpoint/optimizer_state_dict.h"  // moved to checkpoint/optimizer_state_dict.h
