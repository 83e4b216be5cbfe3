// CSA_HD marks helpers compiled for both the host and, under nvcc, the device (a header
// that needs them inline, fp4_quant.h, defines it first).
#pragma once

#ifndef CSA_HD
#ifdef __CUDACC__
#define CSA_HD __host__ __device__
#else
#define CSA_HD
#endif
#endif
