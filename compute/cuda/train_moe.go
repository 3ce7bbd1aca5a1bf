package cuda

import (
	"errors"
	"fmt"

	"distill/compute"
)

// ErrNoMoETraining is what MoEForward and MoEBackward panic with: the
// teacher's MoE (inference, method MoE) runs on the GPU, but the MoE
// training kernels are not written yet. Lacks reports it up front, so a
// Qwen3-MoE student is refused on this backend before its first step.
var ErrNoMoETraining = errors.New("cuda: the MoE training kernels (MoEForward, MoEBackward) are not implemented yet; train Qwen3-MoE students with --device cpu")

// Lacks implements compute.Partial.
func (b *Backend) Lacks(feature string) error {
	if feature == compute.FeatureMoETraining {
		return ErrNoMoETraining
	}
	return nil
}

// MoEForward implements compute.Backend: not yet (ErrNoMoETraining).
func (b *Backend) MoEForward(out, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, tokens int) {
	panic(fmt.Errorf("MoEForward: %w", ErrNoMoETraining))
}

// MoEBackward implements compute.Backend: not yet (ErrNoMoETraining).
func (b *Backend) MoEBackward(dx compute.Tensor, dm *compute.MoEWeights, dout, x compute.Tensor, m *compute.MoEWeights, s *compute.MoESaved, dprob compute.Tensor, tokens int) {
	panic(fmt.Errorf("MoEBackward: %w", ErrNoMoETraining))
}
