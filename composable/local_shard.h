#pragma once
#include "checkpoint/local_shard.h"  // moved to checkpoint/local_shard.h
