package cuda

import "distill/compute"

// MoEForward implements compute.Backend: not yet (ErrNoTraining). The
// teacher's MoE (inference) is implemented; MoE training kernels are part
// of the GPU training backend.
func (b *Backend) MoEForward(out, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, tokens int) {
	noTraining("MoEForward")
}

// MoEBackward implements compute.Backend: not yet (ErrNoTraining).
func (b *Backend) MoEBackward(dx compute.Tensor, dm *compute.MoEWeights, dout, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, dprob compute.Tensor, tokens int) {
	noTraining("MoEBackward")
}
