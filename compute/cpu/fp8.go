package cpu

import (
	"fmt"

	"distill/compute"
)

// FP8 weights (compute's "FP8 weights"): the CPU backend keeps an FP8
// weight as its dequantized fp32 values, E4M3Value(code)·s_j, and
// quantizes a GEMM's input rows the same way before an SGEMM of the
// dequantized values: the definition's arithmetic, fp32 accumulation in
// OpenBLAS's order. It is the reference the CUDA backend's FP8 GEMMs are
// held to, and the FP8 teacher of a machine without a GPU (4 bytes a
// weight here: the point is the arithmetic, not the memory).

var _ compute.FP8Weights = (*Backend)(nil)

// WeightFP8 implements compute.FP8Weights.
func (*Backend) WeightFP8(q *compute.FP8Matrix) (compute.Tensor, error) {
	if q.Rows < 0 || q.Cols < 0 || len(q.Codes) != q.Rows*q.Cols || len(q.Scales) != q.Rows {
		return nil, fmt.Errorf("cpu: FP8 weight (%d, %d) with %d codes and %d scales", q.Rows, q.Cols, len(q.Codes), len(q.Scales))
	}
	out := make([]float32, q.Rows*q.Cols)
	for j := 0; j < q.Rows; j++ {
		compute.FP8DequantizeRow(out[j*q.Cols:(j+1)*q.Cols], q.Codes[j*q.Cols:(j+1)*q.Cols], q.Scales[j])
	}
	return &tensor{dt: compute.F8E4M3, f32: out}, nil
}

// fp8Values returns an FP8 weight's dequantized values, or nil when w is
// not an FP8 weight.
func fp8Values(w compute.Tensor) []float32 {
	if ct := cput(w); ct.dt == compute.F8E4M3 {
		return ct.f32
	}
	return nil
}

// quantRowsFP8 writes dst (rows,cols) = deq(x): each row of x quantized
// to E4M3 under its own scale and dequantized (dst may alias x).
func (b *Backend) quantRowsFP8(dst, x []float32, rows, cols int) {
	b.rows(rows, cols*16, func(_, lo, hi int) {
		codes := make([]uint8, cols)
		for r := lo; r < hi; r++ {
			s := compute.FP8QuantizeRow(codes, x[r*cols:(r+1)*cols])
			compute.FP8DequantizeRow(dst[r*cols:(r+1)*cols], codes, s)
		}
	})
}

// refuseFP8 panics when w is an FP8 weight: backward kernels and training
// take BF16/fp32 weights only.
func refuseFP8(w compute.Tensor, what string) {
	if w != nil && cput(w).dt == compute.F8E4M3 {
		panic(fmt.Sprintf("cpu: %s through an FP8 weight: FP8 weights are a teacher's, forward only", what))
	}
}
