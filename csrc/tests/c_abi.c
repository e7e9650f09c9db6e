/* Calls into the core made from C, the language of its ABI: there any int converts to an enum
 * type, so out-of-range values reach the core as they would from a C (or ctypes) caller. */
#include "gradient_accumulator/gradient_accumulator.h"

size_t ga_test_dtype_size_raw(int dtype) { return ga_dtype_size((ga_dtype)dtype); }
