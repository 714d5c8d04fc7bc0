#pragma once
#include "checkpoint/load_pretrained.h"  // moved to checkpoint/load_pretrained.h
