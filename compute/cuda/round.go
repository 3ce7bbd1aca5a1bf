package cuda

import "distill/compute"

// RoundBF16 implements compute.BF16Rounder: dst (BF16) = src (F32)
// rounded to nearest even by k_f32_to_bf16, the kernel that makes the
// weight shadows (shadow.go) and the per-use roundings of the GEMM
// operands (bf16Operand), so a GEMM given dst reads the bits it reads
// given src. ZeRO stage 3 rounds each rank's parts of the GEMM weights
// with it after the optimizer step and all-gathers the roundings (package
// train's Sharding).
func (b *Backend) RoundBF16(dstT, srcT compute.Tensor, n int) {
	defer b.enter()()
	b.wroteT(dstT)
	dst, src := b.ten(dstT, "RoundBF16 dst"), b.ten(srcT, "RoundBF16 src")
	need(dst, "RoundBF16 dst", n, compute.BF16)
	need(src, "RoundBF16 src", n, compute.F32)
	if n > 0 {
		b.convert("k_f32_to_bf16", dst.p, src.p, int64(n))
	}
}

var _ compute.BF16Rounder = (*Backend)(nil)
