package infer

import (
	"fmt"
	"strings"

	"distill/compute"
	"distill/model"
)

// LoadOptions configure Load.
type LoadOptions struct {
	// Weights is how the teacher holds its decoder layers' Linear
	// weights: WeightsBF16 ("" too: as the checkpoint gives them, the
	// backend choosing the storage) or WeightsFP8 (quantized at load to
	// E4M3 with an fp32 scale per output channel, multiplied W8A8 as
	// compute's "FP8 weights" defines; the embedding, norms, MoE routers
	// and LM head stay as the checkpoint gives them). FP8 changes the
	// teacher's outputs, so it changes its fingerprint.
	Weights WeightFormat
}

// check validates o, naming the value at fault.
func (o LoadOptions) check(be compute.Backend) error {
	switch o.Weights {
	case "", WeightsBF16:
		return nil
	case WeightsFP8:
		if _, ok := be.(compute.FP8Weights); !ok {
			return fmt.Errorf("%w: weights fp8: the %s backend cannot hold FP8 weights", ErrInput, be.Name())
		}
		return nil
	}
	return fmt.Errorf("%w: weights %q: want bf16 or fp8", ErrInput, o.Weights)
}

// quantized reports whether the tensor name is one that o stores in FP8:
// a weight of a decoder layer's Linear (q/k/v/o_proj, gate/up/down_proj,
// the MoE experts' too). Not the MoE router (mlp.gate), the norms, the
// biases, the embedding or the LM head.
func (o LoadOptions) quantized(name string) bool {
	return o.Weights == WeightsFP8 && strings.HasPrefix(name, "model.layers.") && strings.HasSuffix(name, "_proj.weight")
}

// fingerprintSuffix is what an FP8 teacher adds to the checkpoint's hash
// (nothing for BF16, whose fingerprints predate the option): the format
// and the quantization's definition, versioned, so that a cache filled by
// one is never mixed with the other's.
func (o LoadOptions) fingerprintSuffix() string {
	if o.Weights == WeightsFP8 {
		return "weights\x00fp8-e4m3-per-channel-w8a8-v1"
	}
	return ""
}

// bindWeight uploads tensor name of w onto be as o says: FP8 (quantized
// here, per output channel) for the Linears o quantizes, else as Weight
// takes the checkpoint's BF16 or F32.
func bindWeight(be compute.Backend, w *model.Weights, name string, o LoadOptions) (compute.Tensor, error) {
	info, _ := w.Info(name)
	var src any
	var err error
	if info.DType == "BF16" {
		src, err = w.BF16(name)
	} else {
		src, err = w.F32(name)
	}
	if err != nil {
		return nil, err
	}
	if !o.quantized(name) {
		t, err := be.Weight(src)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", name, err)
		}
		return t, nil
	}
	if len(info.Shape) != 2 {
		return nil, fmt.Errorf("tensor %s: FP8 weights are matrices; it has shape %v", name, info.Shape)
	}
	q, err := compute.QuantizeFP8(src, info.Shape[0], info.Shape[1])
	if err != nil {
		return nil, fmt.Errorf("tensor %s: %w", name, err)
	}
	t, err := be.(compute.FP8Weights).WeightFP8(q)
	if err != nil {
		return nil, fmt.Errorf("tensor %s: %w", name, err)
	}
	return t, nil
}

// checkNotFP8Checkpoint refuses a checkpoint already quantized to FP8
// (compressed-tensors "float-quantized", ModelOpt FP8: F8_E4M3 weights
// with weight_scale tensors beside them), which Load does not read yet,
// naming the layout and what to load instead.
func checkNotFP8Checkpoint(dir string, w *model.Weights) error {
	for _, n := range w.Names() {
		info, _ := w.Info(n)
		if info.DType == "F8_E4M3" || info.DType == "F8_E5M2" || strings.HasSuffix(n, ".weight_scale") || strings.HasSuffix(n, ".input_scale") {
			return fmt.Errorf("%w: %s is an FP8-quantized checkpoint (tensor %s, dtype %s: the compressed-tensors float-quantized or ModelOpt FP8 layout, weight in F8_E4M3 with weight_scale beside it), which the teacher cannot load yet: load the BF16 checkpoint with --weights fp8 (quantized at load, per output channel)",
				model.ErrSafetensors, dir, n, info.DType)
		}
	}
	return nil
}
