package infer

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"distill/compute"
	"distill/model"
)

// LoadOptions configure LoadWith and LoadStages.
type LoadOptions struct {
	// Weights is how the teacher holds its decoder layers' Linear
	// weights: WeightsBF16 ("" too: as the checkpoint gives them, the
	// backend choosing the storage) or WeightsFP8 (quantized at load to
	// E4M3 with an fp32 scale per output channel, or an FP8 checkpoint's
	// own codes and scales, see fp8Checkpoint; multiplied W8A8 as
	// compute's "FP8 weights" defines; the embedding, norms, MoE routers
	// and LM head stay as the checkpoint gives them). FP8 changes the
	// teacher's outputs, so it changes its fingerprint. An FP8 checkpoint
	// needs WeightsFP8.
	Weights WeightFormat
	// MicroBatches and MinMicroTokens cut each forward of a pipelined
	// teacher (LoadStages) into micro-batches (decoder.Pipeline's
	// defaults when 0: four a stage, none under 1024 tokens).
	MicroBatches, MinMicroTokens int
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
	if info.DType == "F8_E4M3" { // an FP8 checkpoint's own codes and scales
		q, err := loadFP8(w, name, info)
		if err != nil {
			return nil, err
		}
		t, err := be.(compute.FP8Weights).WeightFP8(q)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", name, err)
		}
		return t, nil
	}
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

// FP8 checkpoints. A checkpoint already quantized to FP8 (compressed-tensors
// "float-quantized", e.g. the FP8-dynamic releases, and ModelOpt's FP8
// export) stores a Linear's weight as F8_E4M3 codes (its torch.nn.Linear
// shape (out, in)) and beside it weight_scale: one fp32 scale for the
// tensor (ModelOpt; compressed-tensors' "tensor" strategy), or one per
// output channel, shape (out) or (out, 1) (compressed-tensors'
// "channel"), the value being code·scale. Both are a per-row scale here
// (a per-tensor one repeated), so the teacher multiplies the checkpoint's
// own codes. The activations are quantized per token at run time as for
// weights quantized at load; a static input_scale in the checkpoint is
// not used (per-token scales are the finer of the two). Block-wise scales
// (weight_scale_inv of 128x128 blocks: Qwen's and DeepSeek's FP8
// releases) do not fit per-row scales and are refused, naming the layout.

// fp8Checkpoint reports whether w holds FP8 Linear weights in a layout
// Load reads (see above), and an error naming the tensor and the layout
// for one it does not.
func fp8Checkpoint(dir string, w *model.Weights) (bool, error) {
	found := false
	for _, n := range w.Names() {
		info, _ := w.Info(n)
		refuse := func(what string) error {
			return fmt.Errorf("%w: %s: tensor %s (%s %v): %s, which the teacher cannot load: load the BF16 checkpoint with --weights fp8 (quantized at load, per output channel)",
				model.ErrSafetensors, dir, n, info.DType, info.Shape, what)
		}
		switch {
		case info.DType == "F8_E5M2":
			return false, refuse("an FP8 E5M2 weight (the teacher's FP8 is E4M3)")
		case strings.HasSuffix(n, ".weight_scale_inv"):
			return false, refuse("block-wise FP8 scales (weight_scale_inv: 128x128 blocks, as Qwen's and DeepSeek's FP8 releases)")
		case info.DType == "F8_E4M3":
			base := strings.TrimSuffix(n, "weight")
			if !strings.HasPrefix(n, "model.layers.") || !strings.HasSuffix(n, "_proj.weight") || len(info.Shape) != 2 {
				return false, refuse("an FP8 tensor that is not a decoder layer's Linear weight")
			}
			if _, ok := w.Info(base + "weight_scale_inv"); ok {
				return false, refuse("block-wise FP8 scales (weight_scale_inv: 128x128 blocks, as Qwen's and DeepSeek's FP8 releases)")
			}
			si, ok := w.Info(base + "weight_scale")
			if !ok {
				return false, refuse("an FP8 weight without a weight_scale beside it")
			}
			if k := si.Numel(); k != 1 && (k != info.Shape[0] || len(si.Shape) > 2 || len(si.Shape) == 2 && si.Shape[1] != 1) {
				return false, refuse(fmt.Sprintf("its weight_scale has shape %v: want one scale (per tensor) or %d (per output channel; block-wise scales are not read)", si.Shape, info.Shape[0]))
			}
			found = true
		}
	}
	return found, nil
}

// checkFP8Checkpoint is model.Weights.Check for an FP8 checkpoint: the
// tensors of cfg with their shapes, a Linear weight in F8_E4M3 or a float
// dtype, and beside an F8_E4M3 weight its weight_scale (and input_scale,
// unused); nothing else.
func checkFP8Checkpoint(cfg *model.Config, w *model.Weights) error {
	want := map[string]bool{}
	var errs []error
	for _, s := range cfg.Tensors() {
		want[s.Name] = true
		info, ok := w.Info(s.Name)
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("missing tensor %s %v", s.Name, s.Shape))
		case !slices.Equal(info.Shape, s.Shape):
			errs = append(errs, fmt.Errorf("tensor %s has shape %v, config.json implies %v", s.Name, info.Shape, s.Shape))
		case info.DType != "BF16" && info.DType != "F16" && info.DType != "F32" && info.DType != "F8_E4M3":
			errs = append(errs, fmt.Errorf("tensor %s has dtype %s; want BF16, F16, F32 or F8_E4M3", s.Name, info.DType))
		}
	}
	for _, n := range w.Names() {
		if want[n] || n == "lm_head.weight" && cfg.TieEmbeddings {
			continue
		}
		if base, ok := strings.CutSuffix(n, "_scale"); ok && (strings.HasSuffix(base, ".weight") || strings.HasSuffix(base, ".input")) {
			wi, _ := w.Info(strings.TrimSuffix(strings.TrimSuffix(base, ".weight"), ".input") + ".weight")
			if wi.DType == "F8_E4M3" {
				continue
			}
		}
		errs = append(errs, fmt.Errorf("unexpected tensor %s (not in a %s checkpoint of this config)", n, cfg.Arch))
	}
	if len(errs) > 0 {
		if len(errs) > 8 {
			errs = append(errs[:8], fmt.Errorf("... and %d more", len(errs)-8))
		}
		return fmt.Errorf("%w: FP8 checkpoint does not match config.json: %w", model.ErrSafetensors, errors.Join(errs...))
	}
	return nil
}

// loadFP8 reads an F8_E4M3 Linear weight and its weight_scale as an
// FP8Matrix (a per-tensor scale repeated for every row).
func loadFP8(w *model.Weights, name string, info model.TensorInfo) (*compute.FP8Matrix, error) {
	codes, _, err := w.Raw(name)
	if err != nil {
		return nil, err
	}
	sc, err := w.F32(strings.TrimSuffix(name, "weight") + "weight_scale")
	if err != nil {
		return nil, err
	}
	rows, cols := info.Shape[0], info.Shape[1]
	scales := sc
	if len(sc) == 1 {
		scales = make([]float32, rows)
		for i := range scales {
			scales[i] = sc[0]
		}
	}
	for i, v := range scales {
		if !(v > 0) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("%w: tensor %s: weight_scale[%d] = %v: want a positive finite scale", model.ErrSafetensors, name, i, v)
		}
	}
	return &compute.FP8Matrix{Codes: codes, Scales: scales, Rows: rows, Cols: cols}, nil
}
