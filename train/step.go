package train

import (
	"errors"
	"fmt"

	"distill/compute"
	"distill/model/decoder"
	"distill/train/loss"
	"distill/train/nvfp4"
)

// Batch is one packed batch: tokens, sample boundaries, loss mask and the
// teacher's top-k (see loss.Targets for the conventions).
type Batch = loss.Targets

// forward checks the batch and runs the decoder, returning the LM head's
// input (N, hidden). key, when not nil, keys a LoRA student's dropout (a
// training batch).
func (s *Student) forward(b *Batch, key *stepRow) (compute.Tensor, error) {
	if err := b.Check(s.Cfg.VocabSize); err != nil {
		return nil, err
	}
	if key != nil {
		s.Model.SetLoRADropout(key.step, key.row)
	}
	lnf, err := s.Model.TrainForward(b.Tokens, b.Starts)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return lnf, nil
}

// recoverOOM turns a device backend's out-of-memory panic (its kernels
// return no errors) into an error wrapping compute.ErrOutOfMemory, naming
// what ran out and the batch's size; any other panic propagates.
func recoverOOM(err *error, what string) {
	r := recover()
	if r == nil {
		return
	}
	if e, ok := r.(error); ok && errors.Is(e, compute.ErrOutOfMemory) {
		*err = fmt.Errorf("%s ran out of device memory: %w", what, e)
		return
	}
	panic(r)
}

// auxCoef is the weight of the load-balancing loss in the loss (HF adds
// router_aux_loss_coef·aux when output_router_logits), 0 when off.
func (s *Student) auxCoef() float64 {
	if s.Cfg.NumExperts == 0 || !s.Cfg.OutputRouterLogits {
		return 0
	}
	return s.Cfg.RouterAuxLossCoef
}

// addAux adds the load-balancing loss of a forward's routing r to st:
// Aux always (MoE students), coef·Aux into Loss when it is on.
func (s *Student) addAux(st *loss.Stats, r decoder.RouterStats) {
	if s.Cfg.NumExperts == 0 {
		return
	}
	st.Aux = r.Aux()
	st.Loss += s.auxCoef() * st.Aux
}

// Forward computes the loss of a batch without gradients (evaluation; also
// the calibration pass of QAD).
func (s *Student) Forward(b *Batch, opt *loss.Options) (st loss.Stats, err error) {
	defer recoverOOM(&err, "the forward")
	if err := opt.Validate(); err != nil {
		return loss.Stats{}, err
	}
	x, err := s.forward(b, nil)
	if err != nil {
		return loss.Stats{}, err
	}
	st, err = s.head.Forward(x, s.Model.Head.W, b, opt)
	if err == nil && s.Cfg.NumExperts > 0 {
		s.addAux(&st, s.Model.Routing())
	}
	return st, err
}

// ForwardBackward computes the loss of a batch and ADDS its gradient to
// the gradient arena (call ZeroGrad first; several calls accumulate
// micro-batches, with normalizer > 0 the global count of counted
// positions, see loss.Head.ForwardBackward). An MoE student with
// output_router_logits adds router_aux_loss_coef times HF's
// load-balancing loss of this batch, weighted like the batch's loss
// (its counted positions over normalizer), so that the micro-batches'
// losses sum to the token-weighted mean the trainer logs.
func (s *Student) ForwardBackward(b *Batch, opt *loss.Options, normalizer float64) (st loss.Stats, err error) {
	p, err := s.ForwardBackwardPending(b, opt, normalizer)
	if err != nil {
		return loss.Stats{}, err
	}
	defer recoverOOM(&err, "reading the loss")
	return p.Stats(), nil
}

// PendingStats are a ForwardBackward's statistics whose loss values, and
// an MoE student's routing statistics, may still be on the device
// (loss.Pending, decoder.PendingRouting).
type PendingStats struct {
	s       *Student
	head    *loss.Pending
	routing *decoder.PendingRouting // nil: a dense student
	rs      *decoder.RouterStats    // routing, once read
}

// Stats returns the row's statistics, reading its loss values (and the
// routing statistics that its load-balancing loss is computed from) from
// the device if they are still there: ForwardBackward's, bit for bit.
func (p *PendingStats) Stats() loss.Stats {
	st := p.head.Stats()
	if p.routing != nil {
		p.s.addAux(&st, p.Routing())
	}
	return st
}

// Routing returns the row's MoE routing statistics (empty for a dense
// student), reading them from the device if they are still there.
func (p *PendingStats) Routing() decoder.RouterStats {
	if p.routing == nil {
		return decoder.RouterStats{}
	}
	if p.rs == nil {
		rs := p.routing.Read()
		p.rs = &rs
	}
	return *p.rs
}

// ForwardBackwardPending is ForwardBackward that does not read the row's
// loss values: it issues the forward, the loss head and the backward,
// and the caller reads the statistics (Stats) when it needs them. The
// trainer reads them once the step's gradient norm is read, so that on
// a GPU the host does not wait for the loss head in the middle of the
// step, which left the GPU idle until the backward was issued.
func (s *Student) ForwardBackwardPending(b *Batch, opt *loss.Options, normalizer float64) (p *PendingStats, err error) {
	defer recoverOOM(&err, "the forward and backward")
	if s.Model.Calibrating() {
		return nil, fmt.Errorf("%w: NVFP4 calibration is running: call Forward on the calibration batches, then FinishCalibration", ErrInvalid)
	}
	if s.Model.CalibratingInputs() {
		return nil, fmt.Errorf("%w: the inputs' amax calibration is running: call Forward on the calibration batches, then FinishInputCalibration", ErrInvalid)
	}
	if err := opt.Validate(); err != nil {
		return nil, err
	}
	key := s.row
	s.row = nil
	if s.lora != nil && s.lora.cfg.Dropout > 0 && key == nil {
		return nil, fmt.Errorf("%w: ForwardBackward of a LoRA student with dropout (p %g) needs the row's place to key its masks: call SetStepRow(step, row) before each row", ErrInvalid, s.lora.cfg.Dropout)
	}
	x, err := s.forward(b, key)
	if err != nil {
		return nil, err
	}
	dlnf := s.Model.HiddenGrad()
	s.be.Zero(dlnf)
	dhead := s.Model.Head.DW
	if s.lora != nil {
		dhead = nil // a frozen head: the loss head makes no weight gradient for it
	}
	if s.sh != nil {
		s.sh.backward()
	}
	hp, err := s.head.ForwardBackwardPending(x, s.Model.Head.W, dlnf, dhead, b, opt, normalizer)
	if err != nil {
		return nil, err
	}
	if coef := s.auxCoef(); coef != 0 {
		w := 1.0
		if normalizer > 0 {
			w = float64(hp.Tokens()) / normalizer
		}
		s.Model.SetRouterAux(coef * w)
	}
	p = &PendingStats{s: s, head: hp}
	if s.Cfg.NumExperts > 0 {
		p.routing = s.Model.RoutingLater() // this row's: a snapshot the next row's forward leaves
	}
	s.Model.Backward()
	if s.sh != nil {
		s.sh.backwardDone()
	}
	return p, nil
}

// stepRow is a training row's place: the optimizer step and the row's
// index in it (SetStepRow).
type stepRow struct{ step, row uint32 }

// SetStepRow says where the next ForwardBackward's batch is in training:
// step, the optimizer step (from 1), and row, the packed row's index in
// the step's rows (over every rank of a data-parallel group). A LoRA
// student with dropout keys its masks by them (and needs them: a
// ForwardBackward without is an error); for any other student they mean
// nothing. They hold for one ForwardBackward.
func (s *Student) SetStepRow(step, row int) { s.row = &stepRow{uint32(step), uint32(row)} }

// EnableQAD switches on NVFP4 fake quantization of every Linear's weight
// and input, MoE experts included (not lm_head, not the embeddings, not
// the MoE routers) and starts calibration: run
// Forward over the calibration batches, then FinishCalibration. Hidden and
// intermediate sizes must be multiples of the 16-element block.
func (s *Student) EnableQAD() error {
	if err := s.qadGathers(); err != nil {
		return err
	}
	if err := s.Model.EnableQAD(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	s.QAD = true
	return nil
}

// qadGathers refuses NVFP4 QAD on a sharded student whose blocks gather
// BF16 weights (Sharding): QAD's calibration and fake quantization read
// the fp32 weights.
func (s *Student) qadGathers() error {
	if s.sh != nil && s.sh.bf16 {
		return fmt.Errorf("%w: NVFP4 QAD on a ZeRO stage %d student that gathers its blocks' weights in BF16: QAD reads them in fp32; make the student with Sharding.FP32Gathers (the trainer does when quant is nvfp4)", ErrInvalid, s.sh.stage)
	}
	return nil
}

// FinishCalibration freezes every amax (see decoder.Model.FinishCalibration).
// A quantizer that saw only zeros is an error naming it.
func (s *Student) FinishCalibration() (err error) {
	defer recoverOOM(&err, "allocating the fake-quantized weights")
	if err := s.Model.FinishCalibration(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	return nil
}

// ExportNVFP4 packs every quantized Linear in ModelOpt's layout, keyed by
// the HF tensor prefix (e.g. "model.layers.0.self_attn.q_proj",
// "model.layers.0.mlp.experts.3.down_proj"), with the input_scale of each.
// MoE routers are not quantized.
//
// A LoRA student exports its merged weights (mergedNVFP4).
func (s *Student) ExportNVFP4() (map[string]*nvfp4.Packed, map[string]float32, error) {
	if s.lora != nil {
		w, amax, err := s.mergedNVFP4()
		if err != nil {
			return nil, nil, err
		}
		packed, inScale := map[string]*nvfp4.Packed{}, map[string]float32{}
		for _, l := range decoder.QuantLayout(s.Cfg) {
			p, err := nvfp4.Pack(l.Name+".weight", w[l.Name+".weight"], l.Out, l.In, amax[l.W])
			if err != nil {
				return nil, nil, err
			}
			packed[l.Name], inScale[l.Name] = p, nvfp4.GlobalScale(amax[l.Input])
		}
		return packed, inScale, nil
	}
	if !s.QAD || s.Model.Calibrating() {
		return nil, nil, fmt.Errorf("%w: NVFP4 export needs QAD enabled and calibrated", ErrInvalid)
	}
	w := s.Weights()
	packed, inScale := map[string]*nvfp4.Packed{}, map[string]float32{}
	for i := range s.Model.Blocks {
		L := &s.Model.Blocks[i]
		a := &L.Attn
		in := map[*decoder.Linear]float32{&a.Q: L.InQKV.Amax, &a.K: L.InQKV.Amax, &a.V: L.InQKV.Amax, &a.O: L.InO.Amax}
		// The MLP, or every expert: an MoE block's experts share its two
		// input quantizers, so each expert's input_scale is the same.
		var mlps []*decoder.MLP
		if L.MLP != nil {
			mlps = append(mlps, L.MLP)
		}
		for e := range L.Experts {
			mlps = append(mlps, &L.Experts[e])
		}
		for _, f := range mlps {
			in[&f.Gate], in[&f.Up], in[&f.Down] = L.InGateUp.Amax, L.InGateUp.Amax, L.InDown.Amax
		}
		for _, l := range L.Linears() {
			p, err := nvfp4.Pack(l.Name+".weight", w[l.Name+".weight"], l.Out, l.In, l.WQ.Amax)
			if err != nil {
				return nil, nil, err
			}
			packed[l.Name] = p
			inScale[l.Name] = nvfp4.GlobalScale(in[l])
		}
	}
	return packed, inScale, nil
}
