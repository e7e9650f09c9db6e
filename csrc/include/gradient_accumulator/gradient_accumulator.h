/* Umbrella header of the gradient-accumulator core C API. */
#ifndef GRADIENT_ACCUMULATOR_GRADIENT_ACCUMULATOR_H_
#define GRADIENT_ACCUMULATOR_GRADIENT_ACCUMULATOR_H_

#include "gradient_accumulator/accumulate.h"
#include "gradient_accumulator/apply.h"
#include "gradient_accumulator/batchnorm.h"
#include "gradient_accumulator/buffers.h"
#include "gradient_accumulator/common.h"
#include "gradient_accumulator/cuda.h"
#include "gradient_accumulator/norms.h"
#include "gradient_accumulator/wgrad.h"

#endif /* GRADIENT_ACCUMULATOR_GRADIENT_ACCUMULATOR_H_ */
