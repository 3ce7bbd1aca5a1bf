package computetest_test

import (
	"sort"
	"testing"

	"distill/compute"
	"distill/compute/computetest"
	"distill/compute/cpu"
)

// counting is the CPU backend with the training methods counted.
type counting struct {
	compute.Backend
	calls map[string]int
}

func (c *counting) MatMulBackward(dx, dw, dbias, dout, x, w compute.Tensor, m, n, k int) {
	c.calls["MatMulBackward"]++
	c.Backend.MatMulBackward(dx, dw, dbias, dout, x, w, m, n, k)
}

func (c *counting) EmbedBackward(dtable, dout, ids compute.Tensor, n, dim int) {
	c.calls["EmbedBackward"]++
	c.Backend.EmbedBackward(dtable, dout, ids, n, dim)
}

func (c *counting) RMSNormBackward(dx, dw, dout, x, w, rstd compute.Tensor, rows, dim int) {
	c.calls["RMSNormBackward"]++
	c.Backend.RMSNormBackward(dx, dw, dout, x, w, rstd, rows, dim)
}

func (c *counting) RoPEBackward(dx, cos, sin compute.Tensor, tokens, heads, headDim int) {
	c.calls["RoPEBackward"]++
	c.Backend.RoPEBackward(dx, cos, sin, tokens, heads, headDim)
}

func (c *counting) AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, starts compute.Tensor, nSeq, maxLen, tokens, nHead, nKV, hd int, scale float32) {
	c.calls["AttentionBackward"]++
	c.Backend.AttentionBackward(dq, dk, dv, dout, q, k, v, out, lse, starts, nSeq, maxLen, tokens, nHead, nKV, hd, scale)
}

func (c *counting) SwiGLUBackward(dgate, dup, dout, gate, up compute.Tensor, n int) {
	c.calls["SwiGLUBackward"]++
	c.Backend.SwiGLUBackward(dgate, dup, dout, gate, up, n)
}

func (c *counting) Dropout(out, x compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	c.calls["Dropout"]++
	c.Backend.Dropout(out, x, d, rows, cols)
}

func (c *counting) DropoutBackward(dx, dout compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	c.calls["DropoutBackward"]++
	c.Backend.DropoutBackward(dx, dout, d, rows, cols)
}

func (c *counting) AdamW(p, g, m, v compute.Tensor, n int, s compute.AdamWStep) {
	c.calls["AdamW"]++
	c.Backend.AdamW(p, g, m, v, n, s)
}

func (c *counting) SumSquares(x compute.Tensor, n int) float64 {
	c.calls["SumSquares"]++
	return c.Backend.SumSquares(x, n)
}

func (c *counting) Scale(x compute.Tensor, n int, s float32) {
	c.calls["Scale"]++
	c.Backend.Scale(x, n, s)
}

func (c *counting) AbsMax(x compute.Tensor, n int) float32 {
	c.calls["AbsMax"]++
	return c.Backend.AbsMax(x, n)
}

func (c *counting) FakeQuantNVFP4(dst, src compute.Tensor, rows, cols int, amax float32) {
	c.calls["FakeQuantNVFP4"]++
	c.Backend.FakeQuantNVFP4(dst, src, rows, cols, amax)
}

func (c *counting) LossHeadForward(h *compute.LossHead) compute.LossStats {
	c.calls["LossHeadForward"]++
	return c.Backend.LossHeadForward(h)
}

func (c *counting) LossHeadBackward(h *compute.LossHead, co *compute.LossCoef, dx, dw compute.Tensor) {
	c.calls["LossHeadBackward"]++
	c.Backend.LossHeadBackward(h, co, dx, dw)
}

var trainingMethods = []string{"MatMulBackward", "EmbedBackward", "RMSNormBackward", "RoPEBackward",
	"AttentionBackward", "SwiGLUBackward", "AdamW", "SumSquares", "Scale", "AbsMax", "FakeQuantNVFP4",
	"LossHeadForward", "LossHeadBackward", "Dropout", "DropoutBackward"}

// TestRunForwardLeavesOutTraining: RunForward (what a forward-only backend
// runs) calls none of the training methods, and Run (the CPU's run) still
// calls every one of them.
func TestRunForwardLeavesOutTraining(t *testing.T) {
	fwd := &counting{Backend: cpu.New(2), calls: map[string]int{}}
	computetest.RunForward(t, fwd, computetest.FP32)
	if len(fwd.calls) != 0 {
		var names []string
		for n := range fwd.calls {
			names = append(names, n)
		}
		sort.Strings(names)
		t.Errorf("RunForward called training methods %v", names)
	}
	all := &counting{Backend: cpu.New(2), calls: map[string]int{}}
	computetest.Run(t, all, computetest.FP32)
	for _, n := range trainingMethods {
		if all.calls[n] == 0 {
			t.Errorf("Run never called %s", n)
		}
	}
}
