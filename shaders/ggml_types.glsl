// ggml's type ids (enum ggml_type, as GGUF stores them) of the weight types the kernels read;
// a kernel's WTYPE define is one of these.
#ifndef VKX_GGML_TYPES_GLSL
#define VKX_GGML_TYPES_GLSL
#define WT_F32 0
#define WT_F16 1
#define WT_Q4_0 2
#define WT_Q4_1 3
#define WT_Q5_0 6
#define WT_Q5_1 7
#define WT_Q8_0 8
#define WT_Q2_K 10
#define WT_Q3_K 11
#define WT_Q4_K 12
#define WT_Q5_K 13
#define WT_Q6_K 14
#define WT_IQ4_NL 20
#define WT_IQ4_XS 23
#define WT_BF16 30
#endif
