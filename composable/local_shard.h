#pragma once
#include "fsdp_cpp/checkpoint/local_shard.h"  // moved to checkpoint/local_shard.h
