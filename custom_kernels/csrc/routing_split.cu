// Splitting a grouped GEMM's routing between two kernels, on the device: one kernel tuned for an
// even routing, one for a skewed routing, both launched, and this kernel, launched before them,
// hands all the rows to one of them and none to the other. A grouped kernel given all-zero
// offsets has no tile to compute and writes nothing (the 2d3d form: groups of rows), so the
// pair computes the product once, with the kernel that suits this routing, and the host never
// reads the offsets (no sync; a CUDA graph replays the choice afresh each time).
//
//   sizes[g]   = offs[g] - offs[g - 1]   (offs[-1] = 0; a decreasing step counts as 0)
//   skewed     = max(sizes) * groups > skew * offs[groups - 1]
//                (the largest group holds more than `skew` times the mean)
//   even[g]    = skewed ? 0 : offs[g]
//   uneven[g]  = skewed ? offs[g] : 0
//
// One block of BLOCK threads: a strided max over the groups, a warp-shuffle and shared-memory
// reduction, then a strided write of both outputs. The offsets are int32 (torch._grouped_mm's);
// `groups` is a 64-bit integer and `skew` a double, as cuda.core packs Python ints and floats.
#ifndef BLOCK
#define BLOCK 256
#endif

extern "C" __global__ void __launch_bounds__(BLOCK)
routing_split(const int* __restrict__ offs, int* __restrict__ even, int* __restrict__ uneven,
              long long groups, double skew) {
    __shared__ int warp_max[BLOCK / 32];
    __shared__ int skewed;
    int largest = 0;
    for (long long g = threadIdx.x; g < groups; g += BLOCK) {
        const int start = g > 0 ? offs[g - 1] : 0;
        largest = max(largest, offs[g] - start);
    }
    for (int delta = 16; delta > 0; delta >>= 1) {
        largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, delta));
    }
    if (threadIdx.x % 32 == 0) {
        warp_max[threadIdx.x / 32] = largest;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < BLOCK / 32; ++w) {
            largest = max(largest, warp_max[w]);
        }
        const double total = groups > 0 ? static_cast<double>(offs[groups - 1]) : 0.0;
        skewed = static_cast<double>(largest) * static_cast<double>(groups) > skew * total;
    }
    __syncthreads();
    const bool to_uneven = skewed != 0;
    for (long long g = threadIdx.x; g < groups; g += BLOCK) {
        const int end = offs[g];
        even[g] = to_uneven ? 0 : end;
        uneven[g] = to_uneven ? end : 0;
    }
}
