#pragma once
#include "fsdp_cpp/checkpoint/distributed_checkpoint.h"  // moved to checkpoint/distributed_checkpoint.h
