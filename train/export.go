package train

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"distill/compute"
	"distill/compute/device"
	"distill/internal/atomicfile"
	"distill/model"
	"distill/model/decoder"
	"distill/train/nvfp4"
)

// LoadHF builds a student from an HF checkpoint directory (config.json and
// safetensors in BF16, F16 or F32) on the CPU backend with one worker per
// core. A missing, extra or mis-shaped tensor is an error naming it and
// the directory.
func LoadHF(dir string) (*Student, error) { return LoadHFOn(dir, device.CPU(0)) }

// LoadHFOn is LoadHF onto the backend be.
func LoadHFOn(dir string, be compute.Backend) (*Student, error) { return loadHF(dir, be, nil) }

// LoadHFSharded is LoadHFOn for one rank of a ZeRO stage 2 or 3 group
// (NewShardedStudentOn): every rank reads the checkpoint and keeps its
// part.
func LoadHFSharded(dir string, be compute.Backend, sh Sharding) (*Student, error) {
	return loadHF(dir, be, &sh)
}

func loadHF(dir string, be compute.Backend, sh *Sharding) (*Student, error) {
	cfg, err := model.LoadConfig(dir)
	if err != nil {
		return nil, err
	}
	s, err := newStudent(cfg, be, sh)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	w, err := model.OpenWeights(dir)
	if err != nil {
		return nil, err
	}
	defer w.Close()
	if err := w.Check(cfg); err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	for i, t := range s.Tensors {
		v, err := w.F32(t.Name)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", dir, err)
		}
		s.write(i, v)
	}
	return s, nil
}

// LoadFrom builds a student of cfg on be (one rank's part of it when sh
// is set) and fills each tensor from read, one whole tensor at a time,
// into a buffer it reuses: the loader of sources that are no HF
// directory (a sharded training checkpoint), holding one tensor of host
// memory at a time.
func LoadFrom(cfg *model.Config, be compute.Backend, sh *Sharding, read func(t Tensor, dst []float32) error) (*Student, error) {
	s, err := newStudent(cfg, be, sh)
	if err != nil {
		return nil, err
	}
	var v []float32
	for i, t := range s.Tensors {
		if cap(v) < t.N {
			v = make([]float32, t.N)
		}
		v = v[:t.N]
		if err := read(t, v); err != nil {
			s.Free()
			return nil, err
		}
		s.write(i, v)
	}
	return s, nil
}

// Weights returns the master weights by HF name: views into Params on a
// host backend (valid until the next optimizer step), copies otherwise.
//
// Sharded, they are gathered from the ranks: every rank of the group
// calls it at once, and each gets them all.
func (s *Student) Weights() map[string][]float32 {
	if s.sh != nil {
		return s.sh.weights(s.Tensors)
	}
	w := make(map[string][]float32, len(s.Tensors))
	for _, t := range s.Tensors {
		if s.Params != nil {
			w[t.Name] = s.Params[t.Off : t.Off+t.N : t.Off+t.N]
			continue
		}
		v := make([]float32, t.N)
		s.be.ReadF32(s.be.View(s.params, t.Off, t.N), v)
		w[t.Name] = v
	}
	return w
}

// WriteHF writes the student as an HF checkpoint directory (config.json +
// model.safetensors) in dtype "BF16" (round to nearest even, what
// `student export` ships) or "F32" (the exact master weights, what training
// checkpoints hold).
//
// A LoRA student is written merged (MergedWeights).
func (s *Student) WriteHF(dir, dtype string) error {
	if s.lora != nil {
		return model.WriteCheckpoint(dir, s.Cfg, s.MergedWeights(), dtype)
	}
	return model.WriteCheckpoint(dir, s.Cfg, s.Weights(), dtype)
}

// QuantAmax returns the calibrated amax of every quantizer in a fixed
// order (per layer: the weights of q, k, v, o, gate, up, down, then the
// inputs of qkv, o, gate/up, down), for training checkpoints. It is nil
// unless QAD is on and calibrated.
func (s *Student) QuantAmax() []float32 { return s.Model.QuantAmax() }

// RestoreQAD switches QAD on with frozen amax values saved by QuantAmax
// (resuming a QAD run: calibration is not repeated, and the weight amax
// stays the one calibrated at the start, not the max of the moved weights).
func (s *Student) RestoreQAD(amax []float32) (err error) {
	defer recoverOOM(&err, "allocating the fake-quantized weights")
	if err := s.qadGathers(); err != nil {
		return err
	}
	if err := s.Model.RestoreQAD(amax); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	s.QAD = true
	return nil
}

// Calibrating reports whether NVFP4 calibration is running (EnableQAD
// called, FinishCalibration not yet).
func (s *Student) Calibrating() bool { return s.Model.Calibrating() }

// ModelOptVersion is the Model-Optimizer version named as the producer of
// NVFP4 exports: the layout below is that of its unified HF export
// (modelopt.torch.export.unified_export_hf) in the 0.2x-0.3x releases.
const ModelOptVersion = "0.31.0"

// WriteNVFP4 writes the QAD student as an NVFP4 checkpoint in
// Model-Optimizer's unified HF layout, which vLLM, SGLang and TensorRT-LLM
// load ("modelopt_fp4"):
//
//	<linear>.weight          U8 (out, in/2)  E2M1 codes, element 2i in the low nibble
//	<linear>.weight_scale    F8_E4M3 (out, in/16) block scales
//	<linear>.weight_scale_2  F32 scalar: weight amax / (6·448)
//	<linear>.input_scale     F32 scalar: input amax / (6·448)
//	everything else          BF16 (embeddings, norms, biases, lm_head, MoE routers)
//
// Every expert of an MoE block is its own Linear
// (model.layers.N.mlp.experts.E.{gate,up,down}_proj), with the dense
// rules: gate/up share one weight_scale_2 per expert (fused as w13 by the
// serving engines), and the block's experts share their input_scales.
// Also config.json with a quantization_config and hf_quant_config.json
// (quant_algo NVFP4, group_size 16, exclude_modules: lm_head and the MoE
// routers). The
// dequantized weights equal the fake-quantized weights of the training
// forward bit for bit (nvfp4.Pack).
//
// A LoRA student writes its merged weights (mergedNVFP4), quantized with
// their own weight amax and the inputs' amax calibrated at the run's
// start.
func (s *Student) WriteNVFP4(dir string) error {
	if s.lora != nil {
		w, amax, err := s.mergedNVFP4()
		if err != nil {
			return err
		}
		return WriteNVFP4From(dir, s.Cfg, amax, func(name string, dst []float32) error {
			copy(dst, w[name])
			return nil
		})
	}
	if _, _, err := s.ExportNVFP4(); err != nil { // the checks: QAD calibrated
		return err
	}
	w := s.Weights()
	return WriteNVFP4From(dir, s.Cfg, s.QuantAmax(), func(name string, dst []float32) error {
		copy(dst, w[name])
		return nil
	})
}

// WriteNVFP4From writes the NVFP4 checkpoint (WriteNVFP4's layout) of a
// model of cfg whose fp32 weights read gives (into dst, the tensor's
// length), quantized with the frozen QAD amax values amax (QuantAmax's
// order, decoder.QuantLayout): one tensor in host memory at a time, so a
// sharded training checkpoint exports without the whole model.
func WriteNVFP4From(dir string, cfg *model.Config, amax []float32, read func(name string, dst []float32) error) error {
	layout := decoder.QuantLayout(cfg)
	if want := len(layout) + 4*cfg.Layers; len(amax) != want { // a weight quantizer a Linear, 4 input quantizers a block
		return fmt.Errorf("%w: NVFP4 export: %d amax values, want %d for this model's %d quantized Linears in %d layers: the QAD state is of another model", ErrInvalid, len(amax), want, len(layout), cfg.Layers)
	}
	byName := map[string]decoder.QuantLinear{}
	for _, l := range layout {
		byName[l.Name+".weight"] = l
	}
	var v []float32
	var buf []byte
	get := func(name string, n int) ([]float32, error) {
		if cap(v) < n {
			v = make([]float32, n)
		}
		v = v[:n]
		return v, read(name, v)
	}
	var cur *nvfp4.Packed // the Linear being written: its weight packs it, its scales follow
	var ts []model.StreamTensor
	for _, spec := range cfg.Tensors() {
		spec := spec
		n := 1
		for _, d := range spec.Shape {
			n *= d
		}
		l, ok := byName[spec.Name]
		if !ok {
			ts = append(ts, model.StreamTensor{Name: spec.Name, DType: "BF16", Shape: spec.Shape, Bytes: func() ([]byte, error) {
				x, err := get(spec.Name, n)
				if err != nil {
					return nil, err
				}
				buf = model.BF16Bytes(buf, x)
				return buf, nil
			}})
			continue
		}
		ts = append(ts,
			model.StreamTensor{Name: spec.Name, DType: "U8", Shape: []int{l.Out, l.In / 2}, Bytes: func() ([]byte, error) {
				x, err := get(spec.Name, n)
				if err != nil {
					return nil, err
				}
				if cur, err = nvfp4.Pack(spec.Name, x, l.Out, l.In, amax[l.W]); err != nil {
					return nil, err
				}
				return cur.Weight, nil
			}},
			model.StreamTensor{Name: l.Name + ".weight_scale", DType: "F8_E4M3", Shape: []int{l.Out, l.In / nvfp4.BlockSize}, Bytes: func() ([]byte, error) { return cur.WeightScale, nil }},
			model.StreamTensor{Name: l.Name + ".weight_scale_2", DType: "F32", Shape: []int{}, Bytes: func() ([]byte, error) { return scalarF32("", cur.WeightScale2).Data, nil }},
			model.StreamTensor{Name: l.Name + ".input_scale", DType: "F32", Shape: []int{}, Bytes: func() ([]byte, error) { return scalarF32("", nvfp4.GlobalScale(amax[l.Input])).Data, nil }},
		)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := model.WriteSafetensorsStream(filepath.Join(dir, "model.safetensors"), ts, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	// Excluded: the LM head and, as ModelOpt lists them for Qwen3-MoE,
	// every MoE router (model.layers.N.mlp.gate).
	exclude := []string{"lm_head"}
	for i := 0; i < cfg.Layers; i++ {
		if cfg.IsMoE(i) {
			exclude = append(exclude, fmt.Sprintf("model.layers.%d.mlp.gate", i))
		}
	}
	producer := map[string]any{"name": "modelopt", "version": ModelOptVersion}
	quant := map[string]any{
		"quant_algo":          "NVFP4",
		"kv_cache_quant_algo": nil,
		"group_size":          nvfp4.BlockSize,
		"exclude_modules":     exclude,
	}
	hfq, _ := json.MarshalIndent(map[string]any{"producer": producer, "quantization": quant}, "", "  ")
	cj, err := cfg.JSON()
	if err != nil {
		return err
	}
	var hf map[string]any
	if err := json.Unmarshal(cj, &hf); err != nil {
		return err
	}
	// quantization_config as ModelOpt's convert_hf_quant_config_format
	// writes it: the legacy fields (quant_algo, group_size,
	// exclude_modules) and the compressed-tensors-style config_groups /
	// ignore that newer loaders read.
	fp4 := map[string]any{"num_bits": 4, "type": "float", "group_size": nvfp4.BlockSize, "dynamic": false}
	hf["quantization_config"] = map[string]any{
		"quant_method":        "modelopt",
		"quant_algo":          "NVFP4",
		"kv_cache_quant_algo": nil,
		"group_size":          nvfp4.BlockSize,
		"exclude_modules":     exclude,
		"ignore":              exclude,
		"config_groups":       map[string]any{"group_0": map[string]any{"targets": []string{"Linear"}, "weights": fp4, "input_activations": fp4}},
		"producer":            producer,
	}
	cjq, _ := json.MarshalIndent(hf, "", "  ")
	for name, b := range map[string][]byte{"config.json": cjq, "hf_quant_config.json": hfq} {
		if err := writeFileAtomic(filepath.Join(dir, name), append(b, '\n')); err != nil {
			return err
		}
	}
	return nil
}

// scalarF32 is a 0-dimensional F32 tensor.
func scalarF32(name string, v float32) model.Tensor {
	t := model.F32Tensor(name, nil, []float32{v})
	t.Shape = []int{}
	return t
}

// writeFileAtomic writes data to path through internal/atomicfile, so a
// crash leaves the old file or the new one, never a torn one.
func writeFileAtomic(path string, data []byte) error {
	if err := atomicfile.WriteFile(path, data, 0o644); err != nil {
		return fmt.Errorf("train: %w", err)
	}
	return nil
}

// headTopK runs the teacher's streaming LM head (compute.Backend's
// LMHeadTopK) on the final hidden states lnf (N, hidden) of a forward:
// each position's top-k ids, by descending logit with ties to the lower
// id, and their log-probs normalized over the full vocabulary.
func (s *Student) headTopK(lnf compute.Tensor, N, k int) ([]int32, []float32) {
	be := s.be
	idT, lpT := be.New(compute.I32, N*k), be.New(compute.F32, N*k)
	defer be.Free(idT)
	defer be.Free(lpT)
	be.LMHeadTopK(idT, lpT, lnf, s.Model.Head.W, N, s.Cfg.Hidden, s.Cfg.VocabSize, k)
	ids, lps := make([]int32, N*k), make([]float32, N*k)
	be.ReadI32(idT, ids)
	be.ReadF32(lpT, lps)
	return ids, lps
}

// LogProbs runs the forward over b (its teacher fields are ignored) and
// returns the student's next-token log-probs (N, V), normalized over the
// full vocabulary, the quantity the teacher's top-k caches, through the
// teacher's own LM-head kernel with k = V. Memory is N·V floats and time
// O(N·V·log V): for tests and small batches (Predict uses k = 1).
func (s *Student) LogProbs(b *Batch) ([]float32, error) {
	lnf, err := s.forward(b, nil)
	if err != nil {
		return nil, err
	}
	N, V := len(b.Tokens), s.Cfg.VocabSize
	ids, lps := s.headTopK(lnf, N, V)
	out := make([]float32, N*V)
	for t := 0; t < N; t++ {
		for j := 0; j < V; j++ {
			out[t*V+int(ids[t*V+j])] = lps[t*V+j]
		}
	}
	return out, nil
}

// Predict runs the forward over b and returns the student's most likely
// next token at every position (N), ties to the lowest id: the LM head's
// top-1, so (N, V) logits are never held.
func (s *Student) Predict(b *Batch) ([]int32, error) {
	ids, _, err := s.Top1(b)
	return ids, err
}
