#pragma once
#include "checkpoint/distributed_checkpoint.h"  // moved to checkpoint/distributed_checkpoint.h
