package train

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"distill/compute"
	"distill/model"
	"distill/model/decoder"
	"distill/train/loss"
)

// LoRA students (Hu et al., 2021, with PEFT's semantics): the base model
// is frozen and every targeted Linear gets an adapter,
//
//	y = x·Wᵀ + (alpha/r)·dropout(x)·Aᵀ·Bᵀ,   A (r, in) Kaiming-uniform, B (out, r) zero,
//
// so training starts from the base's outputs exactly. The dropout
// (lora_dropout p, inverted: kept inputs scaled by 1/(1-p)) acts in
// ForwardBackward only, never in Forward (evaluation) or the merged
// export. Its masks come from a counter-based generator
// (compute.DropoutMask: Philox4x32-10) keyed by model.lora.seed, the
// adapter's layer and module (dropoutStream), the optimizer step and the
// row's index in the step (SetStepRow), and counted by the element's
// token and column in the row: nothing a checkpoint does not hold, so a
// resumed run draws the uninterrupted run's masks, and a data-parallel
// rank draws for a row what one process would. Only the adapters
// are parameters: Tensors, the parameter and gradient arenas, Groups,
// Weights and the optimizer's moments hold them alone (fp32), and the
// rest of the training machinery (accumulation, clipping, AdamW, ZeRO-1,
// checkpoints of Weights and moments) trains them unchanged.
//
// The base is held once, frozen, in its own arena in the backend's
// activation dtype: BF16 on the CUDA backend (its GEMMs read BF16
// weights directly, so no fp32 master, gradient, moment or BF16 copy
// exists for it), fp32 on the CPU (the values as stored, widened). Its
// norms, embeddings and LM head are frozen too (PEFT's default): the
// backward makes no weight gradient for them (the fused loss head takes
// no dw for a frozen LM head and skips that GEMM); the norms' go to a
// small scratch that is never read (decoder.Model.AttachLoRA).
//
// Under NVFP4 (quant: nvfp4) the base is held fake-quantized: every
// block Linear's weight is replaced once, at load, by its NVFP4
// fake-quantization (per-tensor amax = max |w|, unified over q/k/v and
// over gate/up as the QAD export does), as QLoRA holds its base in
// 4 bits, and the adapters train in fp32 on top. Unlike QAD nothing is
// trained through a quantizer: the activations are not quantized, and
// the weights the forward multiplies never move (see docs/design.md,
// LoRA students). The inputs' amax are calibrated for the merged model's
// NVFP4 export only (lora_nvfp4.go).

// LoRAModules are the module names an adapter may target (PEFT's
// target_modules for Llama and Qwen).
var LoRAModules = []string{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}

// LoRAConfig is a LoRA student's adapters, in PEFT's LoraConfig terms.
type LoRAConfig struct {
	Rank    int      `json:"r"`
	Alpha   float64  `json:"lora_alpha"`
	Dropout float64  `json:"lora_dropout"`
	Targets []string `json:"target_modules"`
	// Init is A's initialization: "kaiming" (PEFT's default,
	// init_lora_weights=True: Kaiming-uniform with a = sqrt(5), i.e.
	// U(-1/sqrt(in), 1/sqrt(in))) or "gaussian" (N(0, 1/r²)). B is zero.
	Init string `json:"init"`
	// Seed draws A and keys the dropout masks (dropoutStream).
	Seed uint64 `json:"seed"`
	// NVFP4: the base is held NVFP4-fake-quantized (QLoRA-style).
	NVFP4 bool `json:"nvfp4,omitempty"`
}

// Scale is alpha/r, PEFT's scaling (use_rslora false).
func (c *LoRAConfig) Scale() float32 { return float32(c.Alpha / float64(c.Rank)) }

// Check refuses a configuration that is not one (rank, alpha, dropout,
// init, targets), naming the key; cfg, when not nil, is the architecture
// the targets must exist in.
func (c *LoRAConfig) Check(cfg *model.Config) error {
	switch {
	case c.Rank <= 0:
		return fmt.Errorf("%w: model.lora.rank %d: want a positive rank (8, 16, 64, ...)", ErrInvalid, c.Rank)
	case !(c.Alpha > 0) || math.IsInf(c.Alpha, 0):
		return fmt.Errorf("%w: model.lora.alpha %g: want a positive number (the adapters' scale is alpha/rank)", ErrInvalid, c.Alpha)
	case !(c.Dropout >= 0 && c.Dropout < 1):
		return fmt.Errorf("%w: model.lora.dropout %g: want 0 <= dropout < 1", ErrInvalid, c.Dropout)
	case c.Init != "kaiming" && c.Init != "gaussian":
		return fmt.Errorf("%w: model.lora.init %q: want kaiming (PEFT's default) or gaussian", ErrInvalid, c.Init)
	case len(c.Targets) == 0:
		return fmt.Errorf("%w: model.lora.targets: empty; name the modules to adapt, from %s", ErrInvalid, strings.Join(LoRAModules, ", "))
	}
	seen := map[string]bool{}
	for _, t := range c.Targets {
		if seen[t] {
			return fmt.Errorf("%w: model.lora.targets names %s twice", ErrInvalid, t)
		}
		seen[t] = true
		if !slices.Contains(LoRAModules, t) {
			return fmt.Errorf("%w: model.lora.targets: %q is not a module of a llama, qwen2 or qwen3 student; the modules are %s", ErrInvalid, t, strings.Join(LoRAModules, ", "))
		}
	}
	if cfg == nil {
		return nil
	}
	return nil
}

// loraTarget reports whether the base tensor name is the weight of a
// Linear the adapters target, and its module name.
func (c *LoRAConfig) loraTarget(name string) (module string, ok bool) {
	if blockOf(name) < 0 || !strings.HasSuffix(name, "_proj.weight") {
		return "", false
	}
	lin := strings.TrimSuffix(name, ".weight")
	module = lin[strings.LastIndex(lin, ".")+1:]
	return module, slices.Contains(c.Targets, module)
}

// dropoutStream is the dropout key (compute.DropoutMask.Key) of the
// adapter on Linear lin ("model.layers.3.self_attn.q_proj"): SplitMix64's
// finalizer chained over a tag, the seed, the layer and the module's
// index in LoRAModules (and an MoE expert's index), so that every adapter
// draws masks of its own (as PEFT gives each adapted module its own
// nn.Dropout, every expert's included) and the seed moves them all.
// Format of the masks: changing it changes what a resumed run draws.
func dropoutStream(seed uint64, lin string) uint64 {
	module := slices.Index(LoRAModules, lin[strings.LastIndex(lin, ".")+1:])
	h := splitmix64(seed ^ 0x6c6f_7261_2d64_726f) // "lora-dro"
	h = splitmix64(h ^ uint64(blockOf(lin+".weight")))
	h = splitmix64(h ^ uint64(module))
	if e := expertOf(lin); e >= 0 { // an MoE expert's: one more link, its index
		h = splitmix64(h ^ uint64(e))
	}
	return h
}

// expertOf is the expert index of an MoE expert's Linear
// ("model.layers.3.mlp.experts.17.gate_proj": 17), -1 for any other.
func expertOf(lin string) int {
	_, rest, ok := strings.Cut(lin, ".mlp.experts.")
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(rest[:strings.IndexByte(rest+".", '.')])
	if err != nil {
		return -1
	}
	return n
}

// splitmix64 is SplitMix64's output function on x + the golden gamma
// (Steele, Lea and Flood, 2014), a 64-bit mixer.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// BaseSource returns a base tensor's values by HF name (the whole
// tensor, fp32 on the host).
type BaseSource func(name string) ([]float32, error)

// loraState is what a LoRA student holds beside the adapters.
type loraState struct {
	cfg       LoRAConfig
	base      compute.Tensor // the frozen base, every tensor of cfg.Tensors() at baseOff
	baseTs    []Tensor
	hash      string
	adapterOf map[string][2]int // a Linear's name -> its A and B in Tensors
}

// LoRA returns the student's adapters' configuration, nil for a full
// student.
func (s *Student) LoRA() *LoRAConfig {
	if s.lora == nil {
		return nil
	}
	c := s.lora.cfg
	return &c
}

// BaseHash is the content hash of a LoRA student's base: SHA-256 over
// every tensor of the config in order (name, shape, fp32 values little
// endian, as read before any rounding or quantization), "" for a full
// student. A LoRA checkpoint refers to its base by it.
func (s *Student) BaseHash() string {
	if s.lora == nil {
		return ""
	}
	return s.lora.hash
}

// baseAlign is the alignment, in elements, of each base tensor in its
// arena: 128 bytes of BF16, as the activation arena's views, so that the
// GEMMs read every weight in place.
const baseAlign = 64

// NewLoRAStudentOn builds a LoRA student of cfg on be: the base's tensors
// read from base (each once, and hashed), frozen, and adapters on the
// Linears lc targets, A drawn as lc.Init says and B zero.
func NewLoRAStudentOn(cfg *model.Config, be compute.Backend, base BaseSource, lc LoRAConfig) (_ *Student, err error) {
	defer recoverOOM(&err, "allocating the LoRA student's base and adapters")
	switch cfg.Arch {
	case model.ArchLlama, model.ArchQwen2, model.ArchQwen3, model.ArchQwen3MoE:
	default:
		return nil, fmt.Errorf("%w: student architecture %q: want llama, qwen2, qwen3 or qwen3_moe", ErrInvalid, cfg.Arch)
	}
	if err := lc.Check(cfg); err != nil {
		return nil, err
	}
	s := &Student{Cfg: cfg, be: be}
	st := &loraState{cfg: lc, adapterOf: map[string][2]int{}}
	s.lora = st
	specs := cfg.Tensors()
	// The adapters, in the base's order: A then B of each target.
	off := 0
	add := func(name string, shape []int) int {
		n := shape[0] * shape[1]
		s.Tensors = append(s.Tensors, Tensor{Name: name, Shape: shape, Off: off, N: n, Decay: true})
		off += n
		return len(s.Tensors) - 1
	}
	for _, sp := range specs {
		if _, ok := lc.loraTarget(sp.Name); !ok {
			continue
		}
		lin := strings.TrimSuffix(sp.Name, ".weight")
		out, in := sp.Shape[0], sp.Shape[1]
		a := add(lin+".lora_A.weight", []int{lc.Rank, in})
		b := add(lin+".lora_B.weight", []int{out, lc.Rank})
		st.adapterOf[lin] = [2]int{a, b}
	}
	if len(s.Tensors) == 0 {
		return nil, fmt.Errorf("%w: model.lora.targets %v match no Linear of this %s student", ErrInvalid, lc.Targets, cfg.Arch)
	}
	s.params, s.grads = be.New(compute.F32, off), be.New(compute.F32, off)
	if h, ok := be.(compute.Host); ok {
		s.Params, s.Grads = h.HostF32(s.params), h.HostF32(s.grads)
	}
	defer func() {
		if err != nil {
			s.Free()
		}
	}()
	// The base, aligned.
	boff := 0
	byName := map[string]int{}
	for _, sp := range specs {
		n := 1
		for _, d := range sp.Shape {
			n *= d
		}
		boff = (boff + baseAlign - 1) / baseAlign * baseAlign
		byName[sp.Name] = len(st.baseTs)
		st.baseTs = append(st.baseTs, Tensor{Name: sp.Name, Shape: sp.Shape, Off: boff, N: n})
		boff += n
	}
	st.base = be.New(be.ActDType(), boff)
	if err := s.loadBase(base); err != nil {
		return nil, err
	}
	m, err := decoder.New(cfg, be, func(name string) (compute.Tensor, compute.Tensor, error) {
		i, ok := byName[name]
		if !ok {
			return nil, nil, fmt.Errorf("%w: the decoder asks for %s, which is not a tensor of a %s config", ErrInvalid, name, cfg.Arch)
		}
		t := st.baseTs[i]
		return be.View(st.base, t.Off, t.N), nil, nil // frozen: no gradient
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	s.Model = m
	if err := m.AttachLoRA(func(l *decoder.Linear) *compute.LoRA {
		ab, ok := st.adapterOf[l.Name]
		if !ok {
			return nil
		}
		a, b := s.Tensors[ab[0]], s.Tensors[ab[1]]
		return &compute.LoRA{A: be.View(s.params, a.Off, a.N), B: be.View(s.params, b.Off, b.N),
			DA: be.View(s.grads, a.Off, a.N), DB: be.View(s.grads, b.Off, b.N),
			Rank: lc.Rank, In: l.In, Out: l.Out, Scale: lc.Scale(),
			Dropout: lc.Dropout, Stream: dropoutStream(lc.Seed, l.Name)}
	}); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalid, err)
	}
	s.initAdapters()
	s.head = &loss.Head{Backend: be, V: cfg.VocabSize, C: cfg.Hidden}
	return s, nil
}

// loadBase reads every base tensor from src into the base arena (rounded
// to its dtype; NVFP4-fake-quantized first under lc.NVFP4) and hashes
// what it read.
func (s *Student) loadBase(src BaseSource) error {
	st := s.lora
	h := sha256.New()
	// Under NVFP4 a fused group (q/k/v, gate/up) shares the max of its
	// members' amax, as the QAD export unifies them: read the weights'
	// amax first.
	amax := map[string]float32{}
	if st.cfg.NVFP4 {
		for _, t := range st.baseTs {
			if !isBlockLinear(t.Name) {
				continue
			}
			v, err := src(t.Name)
			if err != nil {
				return err
			}
			var a float32
			for _, x := range v {
				a = max(a, float32(math.Abs(float64(x))))
			}
			g := fusedGroup(t.Name)
			amax[g] = max(amax[g], a)
		}
	}
	for _, t := range st.baseTs {
		v, err := src(t.Name)
		if err != nil {
			return err
		}
		if len(v) != t.N {
			return fmt.Errorf("%w: base tensor %s has %d values, want shape %v = %d", ErrInvalid, t.Name, len(v), t.Shape, t.N)
		}
		h.Write([]byte(t.Name))
		for _, d := range t.Shape {
			h.Write(binary.LittleEndian.AppendUint64(nil, uint64(d)))
		}
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		h.Write(b)
		if st.cfg.NVFP4 && isBlockLinear(t.Name) {
			a := amax[fusedGroup(t.Name)]
			if !(a > 0) || math.IsInf(float64(a), 0) {
				return fmt.Errorf("%w: base tensor %s: max |w| is %g: NVFP4 needs a non-zero finite weight", ErrInvalid, t.Name, a)
			}
			q := make([]float32, len(v))
			fakeQuantRows(q, v, t.Shape[0], t.Shape[1], a)
			v = q
		}
		s.be.WriteF32(s.be.View(st.base, t.Off, t.N), v)
	}
	st.hash = hex.EncodeToString(h.Sum(nil))
	return nil
}

// isBlockLinear reports whether name is a block Linear's weight (what
// QAD quantizes: not the embeddings, LM head, norms, biases or routers).
func isBlockLinear(name string) bool {
	return blockOf(name) >= 0 && strings.HasSuffix(name, "_proj.weight")
}

// fusedGroup names the group whose weight amax a block Linear shares:
// q/k/v of a layer, gate/up of a layer's MLP or of an MoE expert; o and
// down stand alone.
func fusedGroup(name string) string {
	for _, p := range []string{"q_proj", "k_proj", "v_proj"} {
		if strings.HasSuffix(name, "self_attn."+p+".weight") {
			return strings.TrimSuffix(name, p+".weight") + "qkv"
		}
	}
	for _, p := range []string{"gate_proj", "up_proj"} {
		// mlp.gate_proj, or an MoE expert's mlp.experts.E.gate_proj (each
		// expert's gate/up pair shares one, as the QAD export's).
		if strings.HasSuffix(name, "."+p+".weight") && strings.Contains(name, ".mlp.") {
			return strings.TrimSuffix(name, p+".weight") + "gate_up"
		}
	}
	return name
}

// fakeQuantRows writes NVFP4's fake quantization of src (rows, cols) with
// the per-tensor amax into dst: 16-element blocks along each row, as the
// backends' FakeQuantNVFP4.
func fakeQuantRows(dst, src []float32, rows, cols int, amax float32) {
	g := compute.NVFP4GlobalScale(amax)
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c += compute.NVFP4BlockSize {
			e := min(c+compute.NVFP4BlockSize, cols)
			compute.NVFP4FakeQuantBlock(dst[r*cols+c:r*cols+e], src[r*cols+c:r*cols+e], g)
		}
	}
}

// initAdapters draws every A (each from its own stream of the seed, so
// that the targets do not shift one another) and zeroes every B.
func (s *Student) initAdapters() {
	lc := &s.lora.cfg
	for i, t := range s.Tensors {
		v := make([]float32, t.N)
		if strings.HasSuffix(t.Name, ".lora_A.weight") {
			r := rand.New(rand.NewPCG(lc.Seed, uint64(i)))
			in := t.Shape[1]
			switch lc.Init {
			case "gaussian":
				sd := 1 / float64(lc.Rank)
				for j := range v {
					v[j] = float32(sd * r.NormFloat64())
				}
			default: // kaiming_uniform_(a=sqrt(5)): bound = gain·sqrt(3/fan_in) = 1/sqrt(in)
				bound := 1 / math.Sqrt(float64(in))
				for j := range v {
					v[j] = float32((2*r.Float64() - 1) * bound)
				}
			}
		}
		s.write(i, v)
	}
}

// LoadAdapters replaces the adapters with those of a PEFT
// adapter_model.safetensors in dir (as WritePEFT writes it); a missing,
// extra or mis-shaped adapter is an error naming it.
func (s *Student) LoadAdapters(dir string) error {
	if s.lora == nil {
		return fmt.Errorf("%w: LoadAdapters on a full student", ErrInvalid)
	}
	w, err := model.OpenFile(filepath.Join(dir, PEFTWeightsFile))
	if err != nil {
		return err
	}
	defer w.Close()
	want := map[string]bool{}
	for i, t := range s.Tensors {
		name := PEFTPrefix + t.Name
		want[name] = true
		info, ok := w.Info(name)
		if !ok {
			return fmt.Errorf("%w: %s/%s has no %s (shape %v): the adapters are of another configuration (model.lora.targets, rank) or model", ErrInvalid, dir, PEFTWeightsFile, name, t.Shape)
		}
		if !slices.Equal(info.Shape, t.Shape) {
			return fmt.Errorf("%w: %s/%s: %s has shape %v, want %v (model.lora.rank %d)", ErrInvalid, dir, PEFTWeightsFile, name, info.Shape, t.Shape, s.lora.cfg.Rank)
		}
		v, err := w.F32(name)
		if err != nil {
			return err
		}
		s.write(i, v)
	}
	for _, n := range w.Names() {
		if !want[n] {
			return fmt.Errorf("%w: %s/%s holds %s, which this configuration has no adapter for (model.lora.targets %v)", ErrInvalid, dir, PEFTWeightsFile, n, s.lora.cfg.Targets)
		}
	}
	return nil
}

// baseWeights returns the base as held (fp32 on the host; BF16 bases
// widened), by HF name.
func (s *Student) baseWeights() map[string][]float32 {
	st := s.lora
	out := make(map[string][]float32, len(st.baseTs))
	for _, t := range st.baseTs {
		v := make([]float32, t.N)
		s.be.ReadF32(s.be.View(st.base, t.Off, t.N), v)
		out[t.Name] = v
	}
	return out
}

// MergedWeights are a LoRA student's weights with the adapters merged,
// PEFT's merge_and_unload: for every adapted Linear, in fp32,
//
//	W' = W + float32(alpha/r) · float32(Σ_k B[o,k]·A[k,i])   (the sum in float64, k ascending)
//
// with W the base as held; every other tensor is the base's.
func (s *Student) MergedWeights() map[string][]float32 {
	w := s.baseWeights()
	ad := s.Weights()
	sc := s.lora.cfg.Scale()
	for lin, ab := range s.lora.adapterOf {
		A, B := ad[s.Tensors[ab[0]].Name], ad[s.Tensors[ab[1]].Name]
		r, in := s.Tensors[ab[0]].Shape[0], s.Tensors[ab[0]].Shape[1]
		out := s.Tensors[ab[1]].Shape[0]
		W := w[lin+".weight"]
		for o := 0; o < out; o++ {
			for i := 0; i < in; i++ {
				var d float64
				for k := 0; k < r; k++ {
					d += float64(B[o*r+k]) * float64(A[k*in+i])
				}
				W[o*in+i] += sc * float32(d)
			}
		}
	}
	return w
}

// The PEFT adapter files (PEFT's save_pretrained): the weights keyed
// "base_model.model.<module>.lora_A.weight" / "lora_B.weight" (the
// adapter's name, "default", left out), and adapter_config.json.
const (
	PEFTWeightsFile = "adapter_model.safetensors"
	PEFTConfigFile  = "adapter_config.json"
	PEFTPrefix      = "base_model.model."
)

// WritePEFT writes the adapters into dir (which must exist) as PEFT
// saves a LoRA adapter: adapter_model.safetensors (fp32) and
// adapter_config.json naming base, the base model's name or path.
func (s *Student) WritePEFT(dir, base string) error {
	if s.lora == nil {
		return fmt.Errorf("%w: --format peft: the student has no LoRA adapters (a full fine-tune); export bf16, f32 or nvfp4", ErrInvalid)
	}
	w := s.Weights()
	var ts []model.Tensor
	for _, t := range s.Tensors {
		ts = append(ts, model.F32Tensor(PEFTPrefix+t.Name, t.Shape, w[t.Name]))
	}
	if err := model.WriteSafetensors(filepath.Join(dir, PEFTWeightsFile), ts, map[string]string{"format": "pt"}); err != nil {
		return err
	}
	b, err := s.PEFTConfig(base)
	if err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, PEFTConfigFile), b)
}

// PEFTConfig is adapter_config.json for these adapters: PEFT's LoraConfig
// fields (peft_type LORA, task_type CAUSAL_LM, r, lora_alpha,
// lora_dropout, target_modules, bias "none", init_lora_weights, ...).
func (s *Student) PEFTConfig(base string) ([]byte, error) {
	lc := s.lora.cfg
	var init any = true
	if lc.Init == "gaussian" {
		init = "gaussian"
	}
	targets := append([]string(nil), lc.Targets...)
	c := map[string]any{
		"peft_type":               "LORA",
		"task_type":               "CAUSAL_LM",
		"base_model_name_or_path": base,
		"revision":                nil,
		"r":                       lc.Rank,
		"lora_alpha":              jsonNumber(lc.Alpha),
		"lora_dropout":            lc.Dropout,
		"target_modules":          targets,
		"bias":                    "none",
		"fan_in_fan_out":          false,
		"init_lora_weights":       init,
		"use_rslora":              false,
		"use_dora":                false,
		"modules_to_save":         nil,
		"layers_to_transform":     nil,
		"layers_pattern":          nil,
		"rank_pattern":            map[string]any{},
		"alpha_pattern":           map[string]any{},
		"inference_mode":          true,
	}
	b, err := json.MarshalIndent(c, "", "  ")
	return append(b, '\n'), err
}

// jsonNumber writes an integral alpha as an integer, as PEFT's configs
// usually hold it.
func jsonNumber(x float64) json.Number {
	if x == math.Trunc(x) && math.Abs(x) < 1<<53 {
		return json.Number(strconv.FormatInt(int64(x), 10))
	}
	return json.Number(strconv.FormatFloat(x, 'g', -1, 64))
}
