package decoder

import (
	"fmt"
	"math"

	"distill/compute"
	"distill/model"
)

// Quantizer holds one tensor's NVFP4 amax. While calibrating, Observe
// raises Amax to the max |x| seen (ModelOpt's max calibrator); Freeze ends
// calibration and Amax stays fixed for the rest of training. When weights
// or activations later grow past it, block scales saturate at 448 and
// values clip to ±6·s: the behaviour of a stale amax in ModelOpt too.
type Quantizer struct {
	Amax        float32
	Calibrating bool
}

// Observe records absmax, the max |x| of one calibration tensor; a no-op
// once frozen. A NaN poisons Amax, so that Freeze refuses it.
func (q *Quantizer) Observe(absmax float32) {
	if q.Calibrating {
		q.Amax = max(q.Amax, absmax)
	}
}

// Freeze ends calibration. An amax of 0 (a tensor that was all zeros
// through calibration), NaN or Inf is an error naming the tensor: every
// value would quantize to zero (or NaN) forever, and the export's scales
// would be 0.
func (q *Quantizer) Freeze(name string) error {
	q.Calibrating = false
	if !(q.Amax > 0) || math.IsInf(float64(q.Amax), 0) {
		return fmt.Errorf("%w: %s: calibrated amax is %g; calibrate on batches where this tensor is non-zero and finite", ErrInvalid, name, q.Amax)
	}
	return nil
}

// QAD reports whether NVFP4 quantization-aware training is on (EnableQAD
// or RestoreQAD ran).
func (m *Model) QAD() bool { return m.qad }

// Calibrating reports whether NVFP4 calibration is running (EnableQAD
// called, FinishCalibration not yet).
func (m *Model) Calibrating() bool { return m.calibrating }

// CalibratingInputs reports whether CalibrateInputs's calibration is
// running (FinishInputCalibration not yet called).
func (m *Model) CalibratingInputs() bool { return m.observing }

// quantInput fake-quantizes x (rows, cols) into dst under QAD, observing
// it instead while calibrating (ModelOpt calibrates with quantization
// off). Without QAD dst is x and nothing happens.
func (m *Model) quantInput(q *Quantizer, dst, x compute.Tensor, rows, cols int) {
	if m.observing { // CalibrateInputs: observe, quantize nothing
		q.Observe(m.be.AbsMax(x, rows*cols))
	}
	switch {
	case !m.qad || dst == x:
	case m.calibrating:
		q.Observe(m.be.AbsMax(x, rows*cols))
		m.be.Copy(dst, m.be.View(x, 0, rows*cols))
	default:
		m.be.FakeQuantNVFP4(dst, x, rows, cols, q.Amax)
	}
}

// EnableQAD switches on NVFP4 fake quantization of every Linear's weight
// and input (not the LM head, not the embeddings) and starts calibration:
// run TrainForward over the calibration batches, then FinishCalibration.
// Hidden and intermediate sizes must be multiples of the 16-element block.
func (m *Model) EnableQAD() error {
	if err := NVFP4Sizes(m.Cfg); err != nil {
		return err
	}
	if m.observing || m.inputsFrozen {
		return fmt.Errorf("%w: EnableQAD on a model whose inputs were calibrated without QAD (CalibrateInputs)", ErrInvalid)
	}
	for i := range m.Blocks {
		L := &m.Blocks[i]
		for _, l := range L.Linears() {
			l.Wfq = nil // set by FinishCalibration; calibration runs unquantized
			l.WQ = Quantizer{Calibrating: true}
		}
		for _, q := range L.inputQuantizers() {
			*q = Quantizer{Calibrating: true}
		}
	}
	m.qad, m.calibrating = true, true
	m.train.arenaN = -1 // the activation arena gains the quantized inputs
	return nil
}

// NVFP4Sizes refuses a model whose Linears NVFP4 cannot quantize: the
// sizes their rows run along must be multiples of the 16-element block.
func NVFP4Sizes(cfg *model.Config) error {
	for _, d := range []struct {
		name string
		v    int
	}{{"hidden_size", cfg.Hidden}, {"intermediate_size", cfg.Intermediate}, {"heads x head_dim", cfg.Heads * cfg.HeadDim},
		{"moe_intermediate_size", cfg.MoEIntermediate}} {
		if d.v%compute.NVFP4BlockSize != 0 {
			return fmt.Errorf("%w: NVFP4 needs %s (%d) to be a multiple of %d", ErrInvalid, d.name, d.v, compute.NVFP4BlockSize)
		}
	}
	return nil
}

// CalibrateInputs starts calibrating the amax of every block Linear's
// input (each block's four input quantizers: q/k/v's, o's, gate/up's,
// down's) without QAD: TrainForward then observes the inputs as QAD's
// calibration does and quantizes nothing. A LoRA student's, whose
// merged model's NVFP4 export needs them; FinishInputCalibration
// freezes them.
func (m *Model) CalibrateInputs() error {
	if err := NVFP4Sizes(m.Cfg); err != nil {
		return err
	}
	if m.qad {
		return fmt.Errorf("%w: CalibrateInputs under QAD (its own calibration covers the inputs)", ErrInvalid)
	}
	for i := range m.Blocks {
		for _, q := range m.Blocks[i].inputQuantizers() {
			*q = Quantizer{Calibrating: true}
		}
	}
	m.observing, m.inputsFrozen = true, false
	return nil
}

// FinishInputCalibration freezes the inputs' amax that CalibrateInputs
// started; one that saw only zeros is an error naming it.
func (m *Model) FinishInputCalibration() error {
	if !m.observing {
		return fmt.Errorf("%w: FinishInputCalibration without CalibrateInputs", ErrInvalid)
	}
	m.observing = false
	for i := range m.Blocks {
		if err := m.Blocks[i].freezeInputs(i); err != nil {
			return err
		}
	}
	m.inputsFrozen = true
	return nil
}

// freezeInputs freezes block i's input quantizers, naming them.
func (L *Block) freezeInputs(i int) error {
	p := fmt.Sprintf("model.layers.%d.", i)
	names := []string{"self_attn.{q,k,v}_proj input", "self_attn.o_proj input", "mlp.{gate,up}_proj input", "mlp.down_proj input"}
	if L.MoE != nil {
		names[2], names[3] = "mlp.experts.*.{gate,up}_proj input", "mlp.experts.*.down_proj input"
	}
	for j, name := range names {
		if err := L.inputQuantizers()[j].Freeze(p + name); err != nil {
			return err
		}
	}
	return nil
}

// InputAmax returns the frozen input amax of CalibrateInputs (or of
// RestoreInputAmax), four a block in the order q/k/v, o, gate/up, down;
// nil when none are frozen.
func (m *Model) InputAmax() []float32 {
	if !m.inputsFrozen {
		return nil
	}
	var out []float32
	for i := range m.Blocks {
		for _, q := range m.Blocks[i].inputQuantizers() {
			out = append(out, q.Amax)
		}
	}
	return out
}

// RestoreInputAmax freezes the inputs' amax to values InputAmax returned
// (a resumed LoRA run's).
func (m *Model) RestoreInputAmax(amax []float32) error {
	if m.qad {
		return fmt.Errorf("%w: RestoreInputAmax under QAD", ErrInvalid)
	}
	if len(amax) != 4*len(m.Blocks) {
		return fmt.Errorf("%w: %d input amax values, want 4 for each of %d layers: they are of another model", ErrInvalid, len(amax), len(m.Blocks))
	}
	for i := range m.Blocks {
		for j, q := range m.Blocks[i].inputQuantizers() {
			*q = Quantizer{Amax: amax[4*i+j]}
		}
		if err := m.Blocks[i].freezeInputs(i); err != nil {
			return err
		}
	}
	m.observing, m.inputsFrozen = false, true
	return nil
}

// observeMoE calibrates an MoE block's input quantizers: the experts'
// input is ln2 (every token reaches K >= 1 experts, so its amax is the
// max over the experts' inputs), the down projections' input is
// silu(gate)·up over every expert's rows, recomputed from the saved
// projections.
func (m *Model) observeMoE(L *Block, a *blockActs, N int) {
	be := m.be
	L.InGateUp.Observe(be.AbsMax(a.ln2, N*m.Cfg.Hidden))
	n := N * L.MoE.TopK * L.MoE.Inter
	h := be.New(compute.F32, n)
	be.SwiGLU(h, a.moe.Gate, a.moe.Up, n)
	L.InDown.Observe(be.AbsMax(h, n))
	be.Free(h)
}

func (L *Block) inputQuantizers() []*Quantizer {
	return []*Quantizer{&L.InQKV, &L.InO, &L.InGateUp, &L.InDown}
}

// FinishCalibration freezes every amax: weights at their current max |w|
// (shared by q/k/v and by gate/up, see below), inputs at the max seen
// during calibration. A quantizer that saw only zeros is an error naming
// it.
func (m *Model) FinishCalibration() error {
	if !m.calibrating {
		return fmt.Errorf("%w: FinishCalibration without EnableQAD", ErrInvalid)
	}
	for i := range m.Blocks {
		L := &m.Blocks[i]
		m.fetch(i) // (calibrating: the weights only)
		for _, l := range L.Linears() {
			l.WQ.Observe(m.be.AbsMax(l.W, l.Out*l.In))
			if err := l.WQ.Freeze(l.Name + ".weight"); err != nil {
				return err
			}
		}
		// Shards that serving engines fuse into one GEMM (q/k/v, gate/up)
		// share one weight amax, the max of theirs: vLLM, SGLang and
		// TensorRT-LLM apply a single weight_scale_2 (the max) to the fused
		// weight, and ModelOpt's export unifies the amax the same way
		// (preprocess_linear_fusion). Unifying here, before training, keeps
		// the export equal to the fake-quantized weights trained on.
		// An MoE block's experts each fuse their own gate/up (w13, one
		// weight_scale_2 per expert).
		groups := [][]*Linear{{&L.Attn.Q, &L.Attn.K, &L.Attn.V}}
		if L.MLP != nil {
			groups = append(groups, []*Linear{&L.MLP.Gate, &L.MLP.Up})
		}
		for e := range L.Experts {
			groups = append(groups, []*Linear{&L.Experts[e].Gate, &L.Experts[e].Up})
		}
		for _, g := range groups {
			var mx float32
			for _, l := range g {
				mx = max(mx, l.WQ.Amax)
			}
			for _, l := range g {
				l.WQ.Amax = mx
			}
		}
		if err := L.freezeInputs(i); err != nil {
			return err
		}
	}
	m.allocFakeQuant()
	m.calibrating = false
	return nil
}

// quantizers lists a block's quantizers in QuantAmax order: the weights of
// q, k, v, o, gate, up, down, then the inputs of qkv, o, gate/up, down.
func (L *Block) quantizers() []*Quantizer {
	var qs []*Quantizer
	for _, l := range L.Linears() {
		qs = append(qs, &l.WQ)
	}
	return append(qs, L.inputQuantizers()...)
}

// QuantLinear is one quantized Linear of a model, and where QuantAmax
// keeps its amax values.
type QuantLinear struct {
	Name    string // the HF module (model.layers.N.self_attn.q_proj, ...)
	Out, In int
	// W and In are the indices in QuantAmax of the Linear's weight
	// quantizer and of its input quantizer (shared: q/k/v's, gate/up's,
	// and an MoE block's experts').
	W, Input int
}

// QuantLayout lists cfg's quantized Linears in QuantAmax order, from the
// config alone (no model, no weights): what an export that streams the
// weights tensor by tensor needs to quantize them with a checkpoint's
// amax. It is New's layout of each block (Linears, then the input
// quantizers qkv, o, gate/up, down); TestQuantLayout holds it to a built
// model's.
func QuantLayout(cfg *model.Config) []QuantLinear {
	h, q, kv := cfg.Hidden, cfg.Heads*cfg.HeadDim, cfg.KVHeads*cfg.HeadDim
	var out []QuantLinear
	k := 0
	for i := 0; i < cfg.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		type lin struct {
			name    string
			out, in int
			input   int // 0 qkv, 1 o, 2 gate/up, 3 down
		}
		ls := []lin{{p + "self_attn.q_proj", q, h, 0}, {p + "self_attn.k_proj", kv, h, 0}, {p + "self_attn.v_proj", kv, h, 0}, {p + "self_attn.o_proj", h, q, 1}}
		if cfg.IsMoE(i) {
			for e := 0; e < cfg.NumExperts; e++ {
				ep := fmt.Sprintf("%smlp.experts.%d.", p, e)
				ls = append(ls, lin{ep + "gate_proj", cfg.MoEIntermediate, h, 2}, lin{ep + "up_proj", cfg.MoEIntermediate, h, 2}, lin{ep + "down_proj", h, cfg.MoEIntermediate, 3})
			}
		} else {
			ls = append(ls, lin{p + "mlp.gate_proj", cfg.Intermediate, h, 2}, lin{p + "mlp.up_proj", cfg.Intermediate, h, 2}, lin{p + "mlp.down_proj", h, cfg.Intermediate, 3})
		}
		for j, l := range ls {
			out = append(out, QuantLinear{Name: l.name, Out: l.out, In: l.in, W: k + j, Input: k + len(ls) + l.input})
		}
		k += len(ls) + 4
	}
	return out
}

// QuantsPerBlock is the number of amax values QuantAmax holds for a dense
// block; an MoE block holds 4 + 3·experts + 4.
const QuantsPerBlock = 11

// quantCount is the number of amax values QuantAmax holds for the model.
func (m *Model) quantCount() int {
	n := 0
	for i := range m.Blocks {
		n += len(m.Blocks[i].quantizers())
	}
	return n
}

// QuantAmax returns the calibrated amax of every quantizer in a fixed
// order (per block, see quantizers), for training checkpoints. It is nil
// unless QAD is on and calibrated.
func (m *Model) QuantAmax() []float32 {
	if !m.qad || m.calibrating {
		return nil
	}
	var out []float32
	for i := range m.Blocks {
		for _, q := range m.Blocks[i].quantizers() {
			out = append(out, q.Amax)
		}
	}
	return out
}

// RestoreQAD switches QAD on with frozen amax values saved by QuantAmax
// (resuming a QAD run: calibration is not repeated, and the weight amax
// stays the one calibrated at the start, not the max of the moved weights).
func (m *Model) RestoreQAD(amax []float32) error {
	if err := m.EnableQAD(); err != nil {
		return err
	}
	if want := m.quantCount(); len(amax) != want {
		return fmt.Errorf("%w: QAD state has %d amax values, want %d for %d layers (%d per dense layer, 8 + 3 per expert for an MoE layer): the checkpoint is of another model", ErrInvalid, len(amax), want, len(m.Blocks), QuantsPerBlock)
	}
	k := 0
	for i := range m.Blocks {
		for j, q := range m.Blocks[i].quantizers() {
			*q = Quantizer{Amax: amax[k]}
			k++
			if err := q.Freeze(fmt.Sprintf("model.layers.%d quantizer %d", i, j)); err != nil {
				return err
			}
		}
	}
	m.allocFakeQuant()
	m.calibrating = false
	return nil
}

// allocFakeQuant carves the fake-quantized weights of every Linear out of
// one arena; when the blocks share weight slots (Residency), block i's
// are in slot i mod Slots, each slot the size of the largest block's.
func (m *Model) allocFakeQuant() {
	blockN := func(i int) int {
		n := 0
		for _, l := range m.Blocks[i].Linears() {
			n += l.Out * l.In
		}
		return n
	}
	slots, per := 0, 0
	if m.sharedSlots() {
		slots = m.res.Slots()
		for i := range m.Blocks {
			per = max(per, blockN(i))
		}
		m.qslot = make([]int, slots)
		for s := range m.qslot {
			m.qslot[s] = -1
		}
	}
	n := slots * per
	if slots == 0 {
		for i := range m.Blocks {
			n += blockN(i)
		}
	}
	if m.qadArena != nil {
		m.be.Free(m.qadArena)
	}
	m.qadArena = m.be.New(compute.F32, n)
	off := 0
	for i := range m.Blocks {
		if slots > 0 {
			off = (i % slots) * per
		}
		for _, l := range m.Blocks[i].Linears() {
			l.Wfq = m.be.View(m.qadArena, off, l.Out*l.In)
			off += l.Out * l.In
		}
	}
}

// quantizeWeights refreshes the fake-quantized weights from the weights
// (after every optimizer step the masters moved). With shared slots the
// blocks' are refreshed as they are fetched instead.
func (m *Model) quantizeWeights() {
	if m.sharedSlots() {
		return
	}
	for i := range m.Blocks {
		for _, l := range m.Blocks[i].Linears() {
			m.be.FakeQuantNVFP4(l.Wfq, l.W, l.Out, l.In, l.WQ.Amax)
		}
	}
}

// QuantizeWeights refreshes the fake-quantized weights now (TrainForward
// does it on every call under QAD); for tests and export checks.
func (m *Model) QuantizeWeights() {
	if m.qad && !m.calibrating {
		m.quantizeWeights()
	}
}
