package loss

import "distill/compute/device"

// testBE is the backend of the tests: the CPU reference with 3 workers, so
// the parallel loops split unevenly.
var testBE = device.CPU(3)

// fwd is Forward on host slices through testBE.
func (h *Head) fwd(x, w []float32, tg *Targets, opt *Options) (Stats, error) {
	if h.Backend == nil {
		h.Backend = testBE
	}
	return h.Forward(testBE.FromF32(x), testBE.FromF32(w), tg, opt)
}

// fwdBwd is ForwardBackward on host slices through testBE: dx and dw are
// accumulated into (+=) as the kernels do.
func (h *Head) fwdBwd(x, w, dx, dw []float32, tg *Targets, opt *Options, normalizer float64) (Stats, error) {
	if h.Backend == nil {
		h.Backend = testBE
	}
	dxt, dwt := testBE.FromF32(dx), testBE.FromF32(dw)
	st, err := h.ForwardBackward(testBE.FromF32(x), testBE.FromF32(w), dxt, dwt, tg, opt, normalizer)
	testBE.ReadF32(dxt, dx)
	testBE.ReadF32(dwt, dw)
	return st, err
}
