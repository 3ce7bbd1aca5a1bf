package infer

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"distill/compute"
	"distill/internal/errkind"
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

	// fp8Block is an FP8 checkpoint's block of scales (rows, columns) when
	// it scales blocks (weight_scale_inv), from its config.json
	// (fp8Checkpoint); zero otherwise.
	fp8Block [2]int
}

// check validates o, naming the value at fault.
func (o LoadOptions) check(be compute.Backend) error {
	switch o.Weights {
	case "", WeightsBF16:
		return nil
	case WeightsFP8:
		if _, ok := be.(compute.FP8Weights); !ok {
			return errkind.Errorf(ErrInput, "weights fp8: the %s backend cannot hold FP8 weights", be.Name())
		}
		return nil
	}
	return errkind.Errorf(ErrInput, "weights %q: want bf16 or fp8", o.Weights)
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
		q, err := loadFP8(w, name, info, o.fp8Block)
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
// not used (per-token scales are the finer of the two).
//
// Block-wise scales (Qwen's and DeepSeek's FP8 releases: weight_scale_inv
// of shape (ceil(out/b0), ceil(in/b1)), the block (b0, b1) from config.json's
// quantization_config.weight_block_size, [128, 128] in those releases, the
// value being code·weight_scale_inv[i/b0][j/b1]) vary along a row, which a
// per-row scale cannot express: the teacher multiplies per-channel codes
// (its FP8 GEMMs scale rows and channels after the product), so a
// block-scaled weight is dequantized to fp32 and quantized again per
// output channel at load (compute.QuantizeFP8). That second rounding is
// the cost of reading these checkpoints: TestFP8Checkpoints measures it
// against the BF16 weights the test's checkpoint was made from.

// fp8Layout is what fp8Checkpoint found: whether the checkpoint holds FP8
// Linear weights, and its scales' block (zero: per tensor or channel).
type fp8Layout struct {
	fp8   bool
	block [2]int
}

// fp8BlockSize reads config.json's quantization_config.weight_block_size
// in dir: [128, 128] when it names none.
func fp8BlockSize(dir string) ([2]int, error) {
	var c struct {
		QC *struct {
			Block []int `json:"weight_block_size"`
		} `json:"quantization_config"`
	}
	raw, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return [2]int{}, err
	}
	if err := json.Unmarshal(raw, &c); err != nil {
		return [2]int{}, errkind.Errorf(model.ErrSafetensors, "%s: config.json: %v", dir, err)
	}
	if c.QC == nil || c.QC.Block == nil {
		return [2]int{128, 128}, nil
	}
	if b := c.QC.Block; len(b) != 2 || b[0] < 1 || b[1] < 1 {
		return [2]int{}, errkind.Errorf(model.ErrSafetensors, "%s: config.json's quantization_config.weight_block_size is %v: want two positive sizes, as [128, 128]", dir, b)
	}
	return [2]int{c.QC.Block[0], c.QC.Block[1]}, nil
}

// fp8Checkpoint reports whether w holds FP8 Linear weights in a layout
// Load reads (see above), and an error naming the tensor and the layout
// for one it does not.
func fp8Checkpoint(dir string, w *model.Weights) (fp8Layout, error) {
	var l fp8Layout
	for _, n := range w.Names() {
		info, _ := w.Info(n)
		refuse := func(what string) error {
			return errkind.Errorf(model.ErrSafetensors, "%s: tensor %s (%s %v): %s, which the teacher cannot load: load the BF16 checkpoint with --weights fp8 (quantized at load, per output channel)",
				dir, n, info.DType, info.Shape, what)
		}
		switch {
		case info.DType == "F8_E5M2":
			return l, refuse("an FP8 E5M2 weight (the teacher's FP8 is E4M3)")
		case strings.HasSuffix(n, ".weight_scale_inv"):
			if wi, ok := w.Info(strings.TrimSuffix(n, "_scale_inv")); !ok || wi.DType != "F8_E4M3" {
				return l, refuse("block-wise FP8 scales beside a weight that is not F8_E4M3")
			}
		case info.DType == "F8_E4M3":
			base := strings.TrimSuffix(n, "weight")
			if !strings.HasPrefix(n, "model.layers.") || !strings.HasSuffix(n, "_proj.weight") || len(info.Shape) != 2 {
				return l, refuse("an FP8 tensor that is not a decoder layer's Linear weight")
			}
			si, hasScale := w.Info(base + "weight_scale")
			bi, hasBlock := w.Info(base + "weight_scale_inv")
			switch {
			case hasScale && hasBlock:
				return l, refuse("both a weight_scale and a weight_scale_inv beside it (one layout or the other)")
			case hasBlock:
				if l.block == ([2]int{}) {
					b, err := fp8BlockSize(dir)
					if err != nil {
						return l, err
					}
					l.block = b
				}
				want := []int{(info.Shape[0] + l.block[0] - 1) / l.block[0], (info.Shape[1] + l.block[1] - 1) / l.block[1]}
				if !slices.Equal(bi.Shape, want) {
					return l, refuse(fmt.Sprintf("its weight_scale_inv has shape %v: blocks of %v (config.json's quantization_config.weight_block_size, [128, 128] when absent) want %v", bi.Shape, l.block, want))
				}
			case !hasScale:
				return l, refuse("an FP8 weight without a weight_scale (or block-wise weight_scale_inv) beside it")
			default:
				if k := si.Numel(); k != 1 && (k != info.Shape[0] || len(si.Shape) > 2 || len(si.Shape) == 2 && si.Shape[1] != 1) {
					return l, refuse(fmt.Sprintf("its weight_scale has shape %v: want one scale (per tensor) or %d (per output channel)", si.Shape, info.Shape[0]))
				}
			}
			l.fp8 = true
		}
	}
	return l, nil
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
		if base, ok := strings.CutSuffix(strings.TrimSuffix(n, "_inv"), "_scale"); ok && (strings.HasSuffix(base, ".weight") || strings.HasSuffix(base, ".input")) {
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
		return errkind.Errorf(model.ErrSafetensors, "FP8 checkpoint does not match config.json: %w", errors.Join(errs...))
	}
	return nil
}

// loadFP8 reads an F8_E4M3 Linear weight and its scales as an FP8Matrix:
// weight_scale per channel, or per tensor repeated for every row; with
// block (its weight_scale_inv's blocks), dequantized and quantized again
// per output channel (see the FP8 checkpoints' comment above).
func loadFP8(w *model.Weights, name string, info model.TensorInfo, block [2]int) (*compute.FP8Matrix, error) {
	codes, _, err := w.Raw(name)
	if err != nil {
		return nil, err
	}
	rows, cols := info.Shape[0], info.Shape[1]
	if _, ok := w.Info(strings.TrimSuffix(name, "weight") + "weight_scale_inv"); ok {
		sc, err := w.F32(strings.TrimSuffix(name, "weight") + "weight_scale_inv")
		if err != nil {
			return nil, err
		}
		f, err := dequantBlockFP8(codes, sc, rows, cols, block)
		if err != nil {
			return nil, errkind.Errorf(model.ErrSafetensors, "tensor %s: %w", name, err)
		}
		q, err := compute.QuantizeFP8(f, rows, cols)
		if err != nil {
			return nil, fmt.Errorf("tensor %s: %w", name, err)
		}
		return q, nil
	}
	sc, err := w.F32(strings.TrimSuffix(name, "weight") + "weight_scale")
	if err != nil {
		return nil, err
	}
	scales := sc
	if len(sc) == 1 {
		scales = make([]float32, rows)
		for i := range scales {
			scales[i] = sc[0]
		}
	}
	for i, v := range scales {
		if !(v > 0) || math.IsInf(float64(v), 0) {
			return nil, errkind.Errorf(model.ErrSafetensors, "tensor %s: weight_scale[%d] = %v: want a positive finite scale", name, i, v)
		}
	}
	return &compute.FP8Matrix{Codes: codes, Scales: scales, Rows: rows, Cols: cols}, nil
}

// dequantBlockFP8 is a block-scaled FP8 weight's values (rows, cols) in
// fp32: E4M3Value(codes[i][j])·scales[i/b0][j/b1] (the fp32 product, as
// the releases' reference dequantization computes it), scales (ceil(rows/
// b0), ceil(cols/b1)) positive and finite.
func dequantBlockFP8(codes []uint8, scales []float32, rows, cols int, block [2]int) ([]float32, error) {
	b0, b1 := block[0], block[1]
	sc := (cols + b1 - 1) / b1
	if len(codes) != rows*cols || len(scales) != ((rows+b0-1)/b0)*sc {
		return nil, fmt.Errorf("block-wise FP8: %d codes and %d scales for a (%d, %d) matrix in blocks of (%d, %d)", len(codes), len(scales), rows, cols, b0, b1)
	}
	for k, v := range scales {
		if !(v > 0) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("weight_scale_inv[%d][%d] = %v: want a positive finite scale", k/sc, k%sc, v)
		}
	}
	f := make([]float32, rows*cols)
	for i := 0; i < rows; i++ {
		srow := scales[(i/b0)*sc : (i/b0+1)*sc]
		for j0 := 0; j0 < cols; j0 += b1 {
			j1 := min(j0+b1, cols)
			compute.FP8DequantizeRow(f[i*cols+j0:i*cols+j1], codes[i*cols+j0:i*cols+j1], srow[j0/b1])
		}
	}
	return f, nil
}
