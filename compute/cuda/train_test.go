package cuda

import (
	"errors"
	"strings"
	"testing"

	"distill/compute"
)

// TestTrainingNotImplemented: every training method of the contract
// panics with ErrNoTraining, naming itself and the way out, before it
// touches the device (no driver needed).
func TestTrainingNotImplemented(t *testing.T) {
	b := &Backend{}
	for name, call := range map[string]func(){
		"MatMulBackward":    func() { b.MatMulBackward(nil, nil, nil, nil, nil, nil, 1, 1, 1) },
		"EmbedBackward":     func() { b.EmbedBackward(nil, nil, nil, 1, 1) },
		"RMSNormBackward":   func() { b.RMSNormBackward(nil, nil, nil, nil, nil, nil, 1, 1) },
		"RoPEBackward":      func() { b.RoPEBackward(nil, nil, nil, 1, 1, 2) },
		"AttentionBackward": func() { b.AttentionBackward(nil, nil, nil, nil, nil, nil, nil, nil, nil, 1, 1, 1, 1, 1, 1, 1) },
		"SwiGLUBackward":    func() { b.SwiGLUBackward(nil, nil, nil, nil, nil, 1) },
		"AdamW":             func() { b.AdamW(nil, nil, nil, nil, 1, compute.AdamWStep{}) },
		"SumSquares":        func() { b.SumSquares(nil, 1) },
		"Scale":             func() { b.Scale(nil, 1, 1) },
		"AbsMax":            func() { b.AbsMax(nil, 1) },
		"FakeQuantNVFP4":    func() { b.FakeQuantNVFP4(nil, nil, 1, 16, 1) },
		"LossHeadForward":   func() { b.LossHeadForward(&compute.LossHead{}) },
		"LossHeadBackward":  func() { b.LossHeadBackward(&compute.LossHead{}, &compute.LossCoef{}, nil, nil) },
	} {
		func() {
			defer func() {
				err, _ := recover().(error)
				want := "cuda: " + name + " is not implemented yet (GPU training backend, issue 16); use --device cpu for training"
				if !errors.Is(err, ErrNoTraining) || err.Error() != want {
					t.Errorf("%s panicked with %v, want %q", name, err, want)
				}
			}()
			call()
			t.Errorf("%s returned", name)
		}()
	}
	if !strings.Contains(ErrNoTraining.Error(), "--device cpu") {
		t.Fatal(ErrNoTraining)
	}
}
