#pragma once
#include "fsdp_cpp/checkpoint/load_pretrained.h"  // moved to checkpoint/load_pretrained.h
