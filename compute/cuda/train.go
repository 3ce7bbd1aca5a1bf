package cuda

import (
	"errors"
	"fmt"

	"distill/compute"
)

// ErrNoTraining is what the training methods of compute.Backend panic with
// (wrapped, naming the method): this backend runs the teacher's forward
// only. The GPU training kernels are issue 16; until then the student
// trains on the CPU, and compute/device refuses --device cuda for training
// before anything runs.
var ErrNoTraining = errors.New("not implemented yet (GPU training backend, issue 16); use --device cpu for training")

// noTraining panics with ErrNoTraining for method. The contract's kernels
// return no errors; compute/device keeps a training run off this backend,
// so reaching here is a caller's bug.
func noTraining(method string) {
	panic(fmt.Errorf("cuda: %s is %w", method, ErrNoTraining))
}

// MatMulBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) MatMulBackward(dx, dw, dbias, dout, x, w compute.Tensor, m, n, k int) {
	noTraining("MatMulBackward")
}

// EmbedBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) EmbedBackward(dtable, dout, ids compute.Tensor, n, dim int) {
	noTraining("EmbedBackward")
}

// RMSNormBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) RMSNormBackward(dx, dw, dout, x, w, rstd compute.Tensor, rows, dim int) {
	noTraining("RMSNormBackward")
}

// RoPEBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) RoPEBackward(dx, cos, sin compute.Tensor, tokens, heads, headDim int) {
	noTraining("RoPEBackward")
}

// AttentionBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) AttentionBackward(dq, dk, dv, dout, q, k, v, lse, starts compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	noTraining("AttentionBackward")
}

// SwiGLUBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) SwiGLUBackward(dgate, dup, dout, gate, up compute.Tensor, n int) {
	noTraining("SwiGLUBackward")
}

// AdamW implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) AdamW(p, g, m, v compute.Tensor, n int, s compute.AdamWStep) {
	noTraining("AdamW")
}

// SumSquares implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) SumSquares(x compute.Tensor, n int) float64 {
	noTraining("SumSquares")
	return 0
}

// Scale implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) Scale(x compute.Tensor, n int, c float32) {
	noTraining("Scale")
}

// AbsMax implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) AbsMax(x compute.Tensor, n int) float32 {
	noTraining("AbsMax")
	return 0
}

// FakeQuantNVFP4 implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) FakeQuantNVFP4(dst, src compute.Tensor, rows, cols int, amax float32) {
	noTraining("FakeQuantNVFP4")
}

// LossHeadForward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) LossHeadForward(h *compute.LossHead) compute.LossStats {
	noTraining("LossHeadForward")
	return compute.LossStats{}
}

// LossHeadBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) LossHeadBackward(h *compute.LossHead, c *compute.LossCoef, dx, dw compute.Tensor) {
	noTraining("LossHeadBackward")
}
