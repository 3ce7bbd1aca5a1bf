package train

import (
	"errors"
	"fmt"
	"math"
	"strings"

	"distill/model/decoder"
)

// The merged model's NVFP4 export (Student.WriteNVFP4 of a LoRA student).
// NVFP4 quantizes a Linear's weight and its input, each with a
// per-tensor amax. The weights' are those of the merged weights
// themselves; the inputs' must be calibrated, which a LoRA run does as
// QAD does, at its start (the trainer: StartInputCalibration, Forward over
// the first calib_batches rows of the training order, then
// FinishInputCalibration), and its checkpoints keep them. The export is
// then Model-Optimizer's layout (WriteNVFP4From) of
//
//	W' = MergedWeights()                       (W + float32(alpha/r)·B·A)
//	weight amax = max |W'|, shared by q/k/v and by gate/up (the fused GEMMs', as QAD's export)
//	input amax  = the calibrated ones
//
// so its dequantized weights are NVFP4's fake quantization of W' bit for
// bit (nvfp4.Pack). Under quant: nvfp4 the base in W' is the
// fake-quantized base the adapters trained on.

// ErrNoInputAmax is wrapped by the error of an NVFP4 export of a LoRA
// student whose inputs' amax were never calibrated.
var ErrNoInputAmax = errors.New("train: no calibrated input amax")

// StartInputCalibration starts calibrating a LoRA student's Linears'
// input amax (decoder.Model.CalibrateInputs): run Forward over the
// calibration batches, then FinishInputCalibration.
func (s *Student) StartInputCalibration() error {
	if s.lora == nil {
		return fmt.Errorf("%w: StartInputCalibration of a full student (QAD's EnableQAD calibrates its inputs)", ErrInvalid)
	}
	if err := s.Model.CalibrateInputs(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// FinishInputCalibration freezes the inputs' amax; one that saw only
// zeros is an error naming it.
func (s *Student) FinishInputCalibration() error {
	if err := s.Model.FinishInputCalibration(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// InputAmax is a LoRA student's frozen input amax (four a layer: the
// inputs of q/k/v, o, gate/up, down), nil when not calibrated.
func (s *Student) InputAmax() []float32 {
	if s.lora == nil {
		return nil
	}
	return s.Model.InputAmax()
}

// RestoreInputAmax freezes a LoRA student's input amax to values
// InputAmax returned (a checkpoint's).
func (s *Student) RestoreInputAmax(amax []float32) error {
	if s.lora == nil {
		return fmt.Errorf("%w: RestoreInputAmax of a full student", ErrInvalid)
	}
	if err := s.Model.RestoreInputAmax(amax); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// mergedNVFP4 returns a LoRA student's merged weights and the amax of
// every quantizer of its NVFP4 export in decoder.QuantLayout's order.
func (s *Student) mergedNVFP4() (map[string][]float32, []float32, error) {
	if err := decoder.NVFP4Sizes(s.Cfg); err != nil {
		return nil, nil, fmt.Errorf("%w: NVFP4 export: %w", ErrInvalid, err)
	}
	in := s.InputAmax()
	if in == nil {
		return nil, nil, fmt.Errorf("%w: %w: NVFP4 export of a LoRA student: its Linears' inputs need a calibrated amax, and this student has none", ErrInvalid, ErrNoInputAmax)
	}
	w := s.MergedWeights()
	layout := decoder.QuantLayout(s.Cfg)
	group := map[string]float32{}
	for _, l := range layout {
		name := l.Name + ".weight"
		var a float32
		for _, x := range w[name] {
			a = max(a, float32(math.Abs(float64(x))))
		}
		g := fusedGroup(name)
		group[g] = max(group[g], a)
	}
	amax := make([]float32, len(layout)+4*s.Cfg.Layers)
	for _, l := range layout {
		name := l.Name + ".weight"
		amax[l.W] = group[fusedGroup(name)]
		if a := amax[l.W]; !(a > 0) || math.IsInf(float64(a), 0) {
			return nil, nil, fmt.Errorf("%w: NVFP4 export: merged %s has max |w| %g: NVFP4 needs a non-zero finite weight", ErrInvalid, name, a)
		}
		amax[l.Input] = in[4*blockOf(name)+inputKind(l.Name)]
	}
	return w, amax, nil
}

// inputKind is which of its block's four input quantizers a Linear reads
// through: 0 q/k/v, 1 o, 2 gate/up, 3 down.
func inputKind(lin string) int {
	switch {
	case strings.HasSuffix(lin, "o_proj"):
		return 1
	case strings.HasSuffix(lin, "gate_proj"), strings.HasSuffix(lin, "up_proj"):
		return 2
	case strings.HasSuffix(lin, "down_proj"):
		return 3
	}
	return 0
}
