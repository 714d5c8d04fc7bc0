#pragma once
#include "fsdp_cpp/checkpoint/full_state_dict_files.h"  // moved to checkpoint/full_state_dict_files.h
