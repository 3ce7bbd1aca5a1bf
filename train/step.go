package train

import (
	"fmt"
	"math"

	"distill/train/loss"
	"distill/train/nn"
	"distill/train/nvfp4"
)

// Batch is one packed batch: tokens, sample boundaries, loss mask and the
// teacher's top-k (see loss.Targets for the conventions).
type Batch = loss.Targets

// prepare checks the batch and sizes the activation arena for it.
func (s *Student) prepare(b *Batch) error {
	if err := b.Check(s.Cfg.VocabSize); err != nil {
		return err
	}
	N := len(b.Tokens)
	if N != s.arenaN || s.arena == nil {
		var a acts
		n := s.carveActs(&a, N, nil)
		if cap(s.arena) < n {
			s.arena = make([]float32, n)
		}
		s.carveActs(&s.acts, N, s.arena[:n])
		s.arenaN = N
	}
	return nil
}

// weight returns the weight a Linear's forward multiplies by: the fake-
// quantized copy under QAD, the master weight otherwise.
func (l *Linear) weight() []float32 {
	if l.Wfq != nil {
		return l.Wfq
	}
	return l.W
}

// quantInput fake-quantizes x (rows, cols) into dst under QAD, observing
// it instead while calibrating (ModelOpt calibrates with quantization off).
func (s *Student) quantInput(q *nvfp4.Quantizer, dst, x []float32, rows, cols int) {
	switch {
	case s.calibrating:
		q.Observe(x)
		copy(dst, x)
	case s.QAD:
		nvfp4.FakeQuant(dst, x, rows, cols, q.Amax)
	}
}

// forward runs the trunk and leaves the final normed hidden states in
// acts.lnf.
func (s *Student) forward(b *Batch) {
	cfg, a := s.Cfg, &s.acts
	N := len(b.Tokens)
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	eps := cfg.RMSNormEps
	scale := float32(1 / math.Sqrt(float64(D)))
	pos := make([]int32, N)
	nn.Positions(pos, b.Starts)
	nn.RopeTable(a.cos, a.sin, pos, s.invFreq, N)
	nn.EmbeddingForward(a.x0, b.Tokens, s.Embed, N, C)
	if s.QAD && !s.calibrating {
		s.quantizeWeights()
	}
	for i := range s.Layers {
		L, l := &s.Layers[i], &a.layers[i]
		nn.RMSNormForward(l.ln1, l.rstd1, l.xin, L.InNorm, N, C, eps)
		s.quantInput(&L.InQKV, l.ln1q, l.ln1, N, C)
		if cfg.QKNorm {
			nn.LinearForward(l.qpre, l.ln1q, L.Q.weight(), L.Q.B, N, C, H*D)
			nn.LinearForward(l.kpre, l.ln1q, L.K.weight(), L.K.B, N, C, KV*D)
			nn.RMSNormForward(l.q, l.qrstd, l.qpre, L.QNorm, N*H, D, eps)
			nn.RMSNormForward(l.k, l.krstd, l.kpre, L.KNorm, N*KV, D, eps)
		} else {
			nn.LinearForward(l.q, l.ln1q, L.Q.weight(), L.Q.B, N, C, H*D)
			nn.LinearForward(l.k, l.ln1q, L.K.weight(), L.K.B, N, C, KV*D)
		}
		nn.LinearForward(l.v, l.ln1q, L.V.weight(), L.V.B, N, C, KV*D)
		nn.RopeForward(l.q, a.cos, a.sin, N, H, D)
		nn.RopeForward(l.k, a.cos, a.sin, N, KV, D)
		nn.AttentionForward(l.att, l.lse, l.q, l.k, l.v, b.Starts, H, KV, D, scale)
		s.quantInput(&L.InO, l.attq, l.att, N, H*D)
		nn.LinearForward(l.xmid, l.attq, L.O.weight(), L.O.B, N, H*D, C)
		nn.Add(l.xmid, l.xin)
		nn.RMSNormForward(l.ln2, l.rstd2, l.xmid, L.PostNorm, N, C, eps)
		s.quantInput(&L.InGateUp, l.ln2q, l.ln2, N, C)
		nn.LinearForward(l.gate, l.ln2q, L.Gate.weight(), nil, N, C, I)
		nn.LinearForward(l.up, l.ln2q, L.Up.weight(), nil, N, C, I)
		nn.SwiGLUForward(l.h, l.gate, l.up, N*I)
		s.quantInput(&L.InDown, l.hq, l.h, N, I)
		nn.LinearForward(l.out, l.hq, L.Down.weight(), nil, N, I, C)
		nn.Add(l.out, l.xmid)
	}
	nn.RMSNormForward(a.lnf, a.rstdf, a.xL, s.FinalNorm, N, C, eps)
}

// Forward computes the loss of a batch without gradients (evaluation).
func (s *Student) Forward(b *Batch, opt *loss.Options) (loss.Stats, error) {
	if err := opt.Validate(); err != nil {
		return loss.Stats{}, err
	}
	if err := s.prepare(b); err != nil {
		return loss.Stats{}, err
	}
	s.forward(b)
	return s.head.Forward(s.acts.lnf, s.Head, b, opt)
}

// ForwardBackward computes the loss of a batch and ADDS its gradient to
// s.Grads (call ZeroGrad first; several calls accumulate micro-batches,
// with normalizer > 0 the global count of counted positions, see
// loss.Head.ForwardBackward).
func (s *Student) ForwardBackward(b *Batch, opt *loss.Options, normalizer float64) (loss.Stats, error) {
	if s.calibrating {
		return loss.Stats{}, fmt.Errorf("%w: NVFP4 calibration is running: call Forward on the calibration batches, then FinishCalibration", ErrInvalid)
	}
	if err := opt.Validate(); err != nil {
		return loss.Stats{}, err
	}
	if err := s.prepare(b); err != nil {
		return loss.Stats{}, err
	}
	s.forward(b)
	cfg, a := s.Cfg, &s.acts
	N := len(b.Tokens)
	C, H, KV, D, I := cfg.Hidden, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.Intermediate
	scale := float32(1 / math.Sqrt(float64(D)))
	clear(a.dln)
	st, err := s.head.ForwardBackward(a.lnf, s.Head, a.dln, s.DHead, b, opt, normalizer)
	if err != nil {
		return st, err
	}
	clear(a.dres)
	nn.RMSNormBackward(a.dres, s.DFinalNorm, a.dln, a.xL, s.FinalNorm, a.rstdf, N, C)
	for i := len(s.Layers) - 1; i >= 0; i-- {
		L, l := &s.Layers[i], &a.layers[i]
		// MLP: out = xmid + down(swiglu(gate(ln2), up(ln2))).
		clear(a.dh)
		nn.LinearBackward(a.dh, L.Down.DW, nil, a.dres, l.hq, L.Down.weight(), N, I, C)
		clear(a.dgate)
		clear(a.dup)
		nn.SwiGLUBackward(a.dgate, a.dup, a.dh, l.gate, l.up, N*I)
		clear(a.dln)
		nn.LinearBackward(a.dln, L.Gate.DW, nil, a.dgate, l.ln2q, L.Gate.weight(), N, C, I)
		nn.LinearBackward(a.dln, L.Up.DW, nil, a.dup, l.ln2q, L.Up.weight(), N, C, I)
		nn.RMSNormBackward(a.dres, L.DPostNorm, a.dln, l.xmid, L.PostNorm, l.rstd2, N, C)
		// Attention: xmid = xin + o(attn(rope(q), rope(k), v)).
		clear(a.datt)
		nn.LinearBackward(a.datt, L.O.DW, L.O.DB, a.dres, l.attq, L.O.weight(), N, H*D, C)
		clear(a.dq)
		clear(a.dk)
		clear(a.dv)
		nn.AttentionBackward(a.dq, a.dk, a.dv, a.datt, l.q, l.k, l.v, l.lse, b.Starts, H, KV, D, scale)
		nn.RopeBackward(a.dq, a.cos, a.sin, N, H, D)
		nn.RopeBackward(a.dk, a.cos, a.sin, N, KV, D)
		dq, dk := a.dq, a.dk
		if cfg.QKNorm {
			clear(a.dqpre)
			clear(a.dkpre)
			nn.RMSNormBackward(a.dqpre, L.DQNorm, a.dq, l.qpre, L.QNorm, l.qrstd, N*H, D)
			nn.RMSNormBackward(a.dkpre, L.DKNorm, a.dk, l.kpre, L.KNorm, l.krstd, N*KV, D)
			dq, dk = a.dqpre, a.dkpre
		}
		clear(a.dln)
		nn.LinearBackward(a.dln, L.Q.DW, L.Q.DB, dq, l.ln1q, L.Q.weight(), N, C, H*D)
		nn.LinearBackward(a.dln, L.K.DW, L.K.DB, dk, l.ln1q, L.K.weight(), N, C, KV*D)
		nn.LinearBackward(a.dln, L.V.DW, L.V.DB, a.dv, l.ln1q, L.V.weight(), N, C, KV*D)
		nn.RMSNormBackward(a.dres, L.DInNorm, a.dln, l.xin, L.InNorm, l.rstd1, N, C)
	}
	nn.EmbeddingBackward(s.DEmbed, a.dres, b.Tokens, N, C)
	return st, nil
}

// EnableQAD switches on NVFP4 fake quantization of every Linear's weight
// and input (not lm_head, not the embeddings) and starts calibration: run
// Forward over the calibration batches, then FinishCalibration. Hidden and
// intermediate sizes must be multiples of the 16-element block.
func (s *Student) EnableQAD() error {
	cfg := s.Cfg
	for _, d := range []struct {
		name string
		v    int
	}{{"hidden_size", cfg.Hidden}, {"intermediate_size", cfg.Intermediate}, {"heads x head_dim", cfg.Heads * cfg.HeadDim}} {
		if d.v%nvfp4.BlockSize != 0 {
			return fmt.Errorf("%w: NVFP4 needs %s (%d) to be a multiple of %d", ErrInvalid, d.name, d.v, nvfp4.BlockSize)
		}
	}
	for i := range s.Layers {
		L := &s.Layers[i]
		for _, l := range L.linears() {
			l.Wfq = nil // set by FinishCalibration; calibration runs unquantized
			l.WQ = nvfp4.Quantizer{Calibrating: true}
		}
		for _, q := range []*nvfp4.Quantizer{&L.InQKV, &L.InO, &L.InGateUp, &L.InDown} {
			*q = nvfp4.Quantizer{Calibrating: true}
		}
	}
	s.QAD, s.calibrating = true, true
	s.arenaN = -1 // the activation arena gains the quantized inputs
	return nil
}

// FinishCalibration freezes every amax: weights at their current max |w|
// (shared by q/k/v and by gate/up, see below), inputs at the max seen
// during calibration. A quantizer that saw only
// zeros is an error naming it.
func (s *Student) FinishCalibration() error {
	if !s.calibrating {
		return fmt.Errorf("%w: FinishCalibration without EnableQAD", ErrInvalid)
	}
	s.allocFakeQuant()
	for i := range s.Layers {
		L := &s.Layers[i]
		for _, l := range L.linears() {
			l.WQ.Observe(l.W)
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
		for _, g := range [][]*Linear{{&L.Q, &L.K, &L.V}, {&L.Gate, &L.Up}} {
			var m float32
			for _, l := range g {
				m = max(m, l.WQ.Amax)
			}
			for _, l := range g {
				l.WQ.Amax = m
			}
		}
		p := fmt.Sprintf("model.layers.%d.", i)
		for _, q := range []struct {
			q    *nvfp4.Quantizer
			name string
		}{{&L.InQKV, "self_attn.{q,k,v}_proj input"}, {&L.InO, "self_attn.o_proj input"}, {&L.InGateUp, "mlp.{gate,up}_proj input"}, {&L.InDown, "mlp.down_proj input"}} {
			if err := q.q.Freeze(p + q.name); err != nil {
				return err
			}
		}
	}
	s.calibrating = false
	return nil
}

// allocFakeQuant carves the fake-quantized weights of every Linear out of
// one arena.
func (s *Student) allocFakeQuant() {
	n := 0
	for i := range s.Layers {
		for _, l := range s.Layers[i].linears() {
			n += len(l.W)
		}
	}
	s.qadArena = make([]float32, n)
	off := 0
	for i := range s.Layers {
		for _, l := range s.Layers[i].linears() {
			l.Wfq = s.qadArena[off : off+len(l.W) : off+len(l.W)]
			off += len(l.W)
		}
	}
}

// quantizeWeights refreshes the fake-quantized weights from the master
// weights (after every optimizer step the masters moved).
func (s *Student) quantizeWeights() {
	for i := range s.Layers {
		for _, l := range s.Layers[i].linears() {
			nvfp4.FakeQuant(l.Wfq, l.W, l.Out, l.In, l.WQ.Amax)
		}
	}
}

// ExportNVFP4 packs every quantized Linear in ModelOpt's layout, keyed by
// the HF tensor prefix (e.g. "model.layers.0.self_attn.q_proj"), with the
// input_scale of each.
func (s *Student) ExportNVFP4() (map[string]*nvfp4.Packed, map[string]float32, error) {
	if !s.QAD || s.calibrating {
		return nil, nil, fmt.Errorf("%w: NVFP4 export needs QAD enabled and calibrated", ErrInvalid)
	}
	packed, inScale := map[string]*nvfp4.Packed{}, map[string]float32{}
	for i := range s.Layers {
		L := &s.Layers[i]
		in := map[*Linear]*nvfp4.Quantizer{&L.Q: &L.InQKV, &L.K: &L.InQKV, &L.V: &L.InQKV, &L.O: &L.InO, &L.Gate: &L.InGateUp, &L.Up: &L.InGateUp, &L.Down: &L.InDown}
		for _, l := range L.linears() {
			p, err := nvfp4.Pack(l.Name+".weight", l.W, l.Out, l.In, l.WQ.Amax)
			if err != nil {
				return nil, nil, err
			}
			packed[l.Name] = p
			inScale[l.Name] = nvfp4.GlobalScale(in[l].Amax)
		}
	}
	return packed, inScale, nil
}
