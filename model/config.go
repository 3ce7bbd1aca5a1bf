// Package model holds what describes a transformer checkpoint: the HF
// config.json of the supported architectures, the safetensors format (read,
// memory-mapped, and write), the table of tensors each architecture expects,
// and random initialization of new checkpoints.
//
// Semantics follow HF transformers' modeling files (LlamaForCausalLM,
// Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM). Anything in a
// config.json that would change the math and that this package does not
// implement is an error naming the field, never a silent default.
package model

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"

	"distill/internal/errkind"
)

// ErrConfig marks an unsupported or inconsistent config.json. Its text
// is in no error's message (errkind): each names what is wrong, and the
// caller names the file or key.
var ErrConfig = errors.New("model: config")

// Arch names an architecture family.
type Arch string

// Supported architectures (HF model_type values).
const (
	ArchLlama    Arch = "llama"
	ArchQwen2    Arch = "qwen2"
	ArchQwen3    Arch = "qwen3"
	ArchQwen3MoE Arch = "qwen3_moe"
)

// hfClass maps an architecture to its HF class name in "architectures".
var hfClass = map[Arch]string{
	ArchLlama:    "LlamaForCausalLM",
	ArchQwen2:    "Qwen2ForCausalLM",
	ArchQwen3:    "Qwen3ForCausalLM",
	ArchQwen3MoE: "Qwen3MoeForCausalLM",
}

// RopeScaling is rope_scaling with rope_type "llama3" (the only scaled rope
// supported; others are a config error).
type RopeScaling struct {
	Factor         float64
	LowFreqFactor  float64
	HighFreqFactor float64
	OriginalMaxPos int
}

// Config is the architecture of a checkpoint, resolved from config.json with
// HF's per-class defaults applied.
type Config struct {
	Arch          Arch
	VocabSize     int
	Hidden        int
	Layers        int
	Heads         int
	KVHeads       int
	HeadDim       int
	Intermediate  int
	MaxPositions  int
	RMSNormEps    float32
	RopeTheta     float64
	RopeScaling   *RopeScaling
	TieEmbeddings bool
	AttentionBias bool // bias on q,k,v (always for Qwen2) and, except Qwen2, on o
	QKNorm        bool // per-head RMSNorm of q and k before RoPE (Qwen3)

	// Qwen3-MoE.
	NumExperts        int
	ExpertsPerTok     int
	MoEIntermediate   int
	DecoderSparseStep int
	NormTopKProb      bool
	MLPOnlyLayers     []int
	// OutputRouterLogits switches on the load-balancing auxiliary loss in
	// training, weighted by RouterAuxLossCoef (HF: output_router_logits,
	// router_aux_loss_coef; defaults false and 0.001).
	OutputRouterLogits bool
	RouterAuxLossCoef  float64

	BOSTokenID, EOSTokenID int // -1 when absent
}

// IsMoE reports whether layer i has a sparse MoE block instead of a dense
// MLP, with Qwen3-MoE's rule: not in mlp_only_layers, and
// (i+1) % decoder_sparse_step == 0.
func (c *Config) IsMoE(i int) bool {
	if c.NumExperts == 0 {
		return false
	}
	for _, l := range c.MLPOnlyLayers {
		if l == i {
			return false
		}
	}
	return (i+1)%c.DecoderSparseStep == 0
}

// InvFreq returns RoPE's inverse frequencies (HeadDim/2), with llama3
// scaling applied as transformers' _compute_llama3_parameters does.
func (c *Config) InvFreq() []float32 {
	half := c.HeadDim / 2
	out := make([]float32, half)
	for i := range out {
		// torch: 1 / base**(arange(0,dim,2).float()/dim), in fp32.
		exp := float32(2*i) / float32(c.HeadDim)
		inv := 1 / math.Pow(c.RopeTheta, float64(exp))
		if s := c.RopeScaling; s != nil {
			lowWav := float64(s.OriginalMaxPos) / s.LowFreqFactor
			highWav := float64(s.OriginalMaxPos) / s.HighFreqFactor
			wav := 2 * math.Pi / inv
			switch {
			case wav > lowWav:
				inv /= s.Factor
			case wav >= highWav: // medium: interpolate
				smooth := (float64(s.OriginalMaxPos)/wav - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				inv = (1-smooth)*inv/s.Factor + smooth*inv
			}
		}
		out[i] = float32(inv)
	}
	return out
}

// Params returns the number of parameters of the checkpoint.
func (c *Config) Params() int64 {
	var n int64
	for _, s := range c.Tensors() {
		p := int64(1)
		for _, d := range s.Shape {
			p *= int64(d)
		}
		n += p
	}
	return n
}

// LoadConfig reads dir/config.json. Its errors are ErrConfig's, their
// messages naming the file.
func LoadConfig(dir string) (*Config, error) {
	path := filepath.Join(dir, "config.json")
	b, err := os.ReadFile(path)
	if err != nil {
		// A student train run directory is what a newcomer has at hand
		// after training: its checkpoints hold optimizer state, may be
		// sharded or LoRA adapters alone, so export is what makes a model.
		if errors.Is(err, fs.ErrNotExist) && isRunDir(dir) {
			return nil, errkind.Errorf(ErrConfig, "%v (%s is a student train run directory, not an HF checkpoint: export it with student export --checkpoint %s --out DIR --format bf16, and give DIR)", err, dir, dir)
		}
		// The directory itself missing, or a file (a model.safetensors
		// given for its directory): say that, not config.json's error.
		if fi, serr := os.Stat(dir); serr != nil && errors.Is(serr, fs.ErrNotExist) {
			return nil, errkind.Errorf(ErrConfig, "checkpoint directory %s does not exist (give the HF checkpoint's directory: the one holding config.json and model.safetensors)", dir)
		} else if serr == nil && !fi.IsDir() {
			return nil, errkind.Errorf(ErrConfig, "%s is a file, not a checkpoint directory (give the directory that holds config.json and model.safetensors: %s)", dir, filepath.Dir(dir))
		}
		return nil, errkind.Errorf(ErrConfig, "%v (a checkpoint directory needs config.json)", err)
	}
	c, err := ParseConfig(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// isRunDir reports whether dir looks like a student train run directory
// (its resolved config.yaml and a checkpoints directory).
func isRunDir(dir string) bool {
	fi, err := os.Stat(filepath.Join(dir, "checkpoints"))
	if err != nil || !fi.IsDir() {
		return false
	}
	_, err = os.Stat(filepath.Join(dir, "config.yaml"))
	return err == nil
}

// rawConfig holds the config.json fields read; pointers tell absent from zero.
type rawConfig struct {
	Architectures         []string        `json:"architectures"`
	ModelType             string          `json:"model_type"`
	VocabSize             *int            `json:"vocab_size"`
	HiddenSize            *int            `json:"hidden_size"`
	NumHiddenLayers       *int            `json:"num_hidden_layers"`
	NumAttentionHeads     *int            `json:"num_attention_heads"`
	NumKeyValueHeads      *int            `json:"num_key_value_heads"`
	HeadDim               *int            `json:"head_dim"`
	IntermediateSize      *int            `json:"intermediate_size"`
	MaxPositionEmbeddings *int            `json:"max_position_embeddings"`
	RMSNormEps            *float64        `json:"rms_norm_eps"`
	RopeTheta             *float64        `json:"rope_theta"`
	RopeScaling           json.RawMessage `json:"rope_scaling"`
	TieWordEmbeddings     *bool           `json:"tie_word_embeddings"`
	AttentionBias         *bool           `json:"attention_bias"`
	MLPBias               *bool           `json:"mlp_bias"`
	HiddenAct             *string         `json:"hidden_act"`
	UseSlidingWindow      *bool           `json:"use_sliding_window"`
	PretrainingTP         *int            `json:"pretraining_tp"`
	NumExperts            *int            `json:"num_experts"`
	NumExpertsPerTok      *int            `json:"num_experts_per_tok"`
	MoEIntermediateSize   *int            `json:"moe_intermediate_size"`
	DecoderSparseStep     *int            `json:"decoder_sparse_step"`
	NormTopKProb          *bool           `json:"norm_topk_prob"`
	MLPOnlyLayers         []int           `json:"mlp_only_layers"`
	OutputRouterLogits    *bool           `json:"output_router_logits"`
	RouterAuxLossCoef     *float64        `json:"router_aux_loss_coef"`
	BOSTokenID            json.RawMessage `json:"bos_token_id"`
	EOSTokenID            json.RawMessage `json:"eos_token_id"`
}

// ParseConfig parses and validates an HF config.json.
func ParseConfig(b []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, errkind.Errorf(ErrConfig, "not valid JSON: %v", err)
	}
	arch, err := parseArch(&r)
	if err != nil {
		return nil, err
	}
	c := &Config{Arch: arch, BOSTokenID: firstID(r.BOSTokenID), EOSTokenID: firstID(r.EOSTokenID)}
	// In this order: each step reads what the steps before it set (the
	// attention shape the sizes, the MoE checks the layer count), and a
	// config with several problems is reported by its first.
	for _, step := range []func(*rawConfig) error{
		c.parseSizes,
		c.parseAttentionShape,
		c.parseRope,
		c.parseLayerOptions,
		c.refuseUnsupported,
		c.parseMoE,
	} {
		if err := step(&r); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// parseArch reads model_type, which picks the architecture, and checks
// that architectures, when given, names the HF class of that model_type:
// a config whose two disagree is edited by hand or broken.
func parseArch(r *rawConfig) (Arch, error) {
	arch := Arch(r.ModelType)
	cls, ok := hfClass[arch]
	if r.ModelType == "" {
		// Not an unsupported model_type "": the key is absent (or empty),
		// and where architectures names a class we know, its model_type
		// is the value to add.
		for a, c := range hfClass {
			if len(r.Architectures) > 0 && r.Architectures[0] == c {
				return "", errkind.Errorf(ErrConfig, "model_type is missing (architectures %q is model_type %s): add \"model_type\": %q", r.Architectures, a, a)
			}
		}
		return "", errkind.Errorf(ErrConfig, "model_type is missing: add the \"model_type\" key of the model's architecture (supported: llama, qwen2, qwen3, qwen3_moe)")
	}
	if !ok {
		return "", errkind.Errorf(ErrConfig, "unsupported model_type %q (supported: llama, qwen2, qwen3, qwen3_moe)", r.ModelType)
	}
	if len(r.Architectures) > 0 && r.Architectures[0] != cls {
		return "", errkind.Errorf(ErrConfig, "architectures %q does not match model_type %q (want %s)", r.Architectures, r.ModelType, cls)
	}
	return arch, nil
}

// sizeKey is a config.json size with no default: the key, its value
// (nil when absent) and the Config field it sets.
type sizeKey struct {
	name string
	p    *int
	dst  *int
}

// requireSizes sets each key's field, failing at the first key that is
// absent or not positive: no HF class default would fit the checkpoint's
// weights, so the error names the key to add or fix.
func requireSizes(keys ...sizeKey) error {
	for _, k := range keys {
		if k.p == nil {
			return errkind.Errorf(ErrConfig, "missing %s", k.name)
		}
		if *k.p <= 0 {
			return errkind.Errorf(ErrConfig, "%s = %d, must be positive", k.name, *k.p)
		}
		*k.dst = *k.p
	}
	return nil
}

// parseSizes reads the sizes every architecture needs.
func (c *Config) parseSizes(r *rawConfig) error {
	return requireSizes(
		sizeKey{"vocab_size", r.VocabSize, &c.VocabSize},
		sizeKey{"hidden_size", r.HiddenSize, &c.Hidden},
		sizeKey{"num_hidden_layers", r.NumHiddenLayers, &c.Layers},
		sizeKey{"num_attention_heads", r.NumAttentionHeads, &c.Heads},
		sizeKey{"intermediate_size", r.IntermediateSize, &c.Intermediate},
		sizeKey{"max_position_embeddings", r.MaxPositionEmbeddings, &c.MaxPositions},
	)
}

// parseAttentionShape reads the key/value heads and the head dimension,
// with each class's default, and checks that they fit the query heads
// (grouped-query attention shares each KV head among a whole number of
// query heads) and RoPE (which rotates pairs of a head's dimensions).
func (c *Config) parseAttentionShape(r *rawConfig) error {
	c.KVHeads = c.Heads
	if r.NumKeyValueHeads != nil {
		c.KVHeads = *r.NumKeyValueHeads
	}
	if c.KVHeads <= 0 || c.Heads%c.KVHeads != 0 {
		return errkind.Errorf(ErrConfig, "num_attention_heads %d is not a multiple of num_key_value_heads %d", c.Heads, c.KVHeads)
	}
	// head_dim: explicit in Qwen3 (class default 128); Llama reads it when
	// present; Qwen2 always derives it.
	switch {
	case r.HeadDim != nil && c.Arch != ArchQwen2:
		c.HeadDim = *r.HeadDim
	case c.Arch == ArchQwen3 || c.Arch == ArchQwen3MoE:
		c.HeadDim = 128
	default:
		if c.Hidden%c.Heads != 0 {
			return errkind.Errorf(ErrConfig, "hidden_size %d is not divisible by num_attention_heads %d", c.Hidden, c.Heads)
		}
		c.HeadDim = c.Hidden / c.Heads
	}
	if c.HeadDim <= 0 || c.HeadDim%2 != 0 {
		return errkind.Errorf(ErrConfig, "head_dim %d must be positive and even (RoPE rotates pairs)", c.HeadDim)
	}
	return nil
}

// parseRope reads rope_theta (default 10000) and rope_scaling.
func (c *Config) parseRope(r *rawConfig) error {
	c.RopeTheta = 10000
	if r.RopeTheta != nil {
		c.RopeTheta = *r.RopeTheta
	}
	if c.RopeTheta <= 0 {
		return errkind.Errorf(ErrConfig, "rope_theta %v must be positive", c.RopeTheta)
	}
	return c.parseRopeScaling(r.RopeScaling)
}

// parseLayerOptions reads what varies between the decoder layers of the
// architectures (the RMSNorm epsilon, tied embeddings, attention biases,
// q/k norms), with the HF class defaults where a key is absent. It fails
// for nothing: what the decoder cannot do is refuseUnsupported's.
func (c *Config) parseLayerOptions(r *rawConfig) error {
	c.RMSNormEps = 1e-6
	if c.Arch == ArchLlama {
		c.RMSNormEps = 1e-6 // LlamaConfig default
	}
	if r.RMSNormEps != nil {
		c.RMSNormEps = float32(*r.RMSNormEps)
	}
	// tie_word_embeddings: PretrainedConfig default is true, but the Llama,
	// Qwen2, Qwen3 and Qwen3-MoE configs default it to false.
	if r.TieWordEmbeddings != nil {
		c.TieEmbeddings = *r.TieWordEmbeddings
	}
	switch c.Arch {
	case ArchQwen2:
		c.AttentionBias = true
	case ArchLlama, ArchQwen3, ArchQwen3MoE:
		if r.AttentionBias != nil {
			c.AttentionBias = *r.AttentionBias
		}
	}
	if c.Arch == ArchQwen3 || c.Arch == ArchQwen3MoE {
		c.QKNorm = true
	}
	return nil
}

// refuseUnsupported fails for the options the decoder does not implement
// (a sliding window, MLP biases, an activation other than SiLU, a
// pretraining_tp that splits the projections): loaded anyway, such a
// checkpoint would compute something other than what it was trained as.
func (c *Config) refuseUnsupported(r *rawConfig) error {
	if c.Arch == ArchQwen2 && r.UseSlidingWindow != nil && *r.UseSlidingWindow {
		return errkind.Errorf(ErrConfig, "use_sliding_window=true is not supported")
	}
	if r.MLPBias != nil && *r.MLPBias {
		return errkind.Errorf(ErrConfig, "mlp_bias=true is not supported")
	}
	if r.HiddenAct != nil && *r.HiddenAct != "silu" {
		return errkind.Errorf(ErrConfig, "hidden_act %q is not supported (only silu)", *r.HiddenAct)
	}
	if r.PretrainingTP != nil && *r.PretrainingTP > 1 {
		return errkind.Errorf(ErrConfig, "pretraining_tp=%d is not supported (only 1)", *r.PretrainingTP)
	}
	return nil
}

// parseMoE reads Qwen3-MoE's experts: how many, how many a token takes,
// their size, which layers have them, and the router. Experts in the
// config of another architecture are an error: it would load as a dense
// model that lacks them.
func (c *Config) parseMoE(r *rawConfig) error {
	if c.Arch != ArchQwen3MoE {
		if r.NumExperts != nil && *r.NumExperts > 0 {
			return errkind.Errorf(ErrConfig, "num_experts set for model_type %q, which has no MoE", c.Arch)
		}
		return nil
	}
	err := requireSizes(
		sizeKey{"num_experts", r.NumExperts, &c.NumExperts},
		sizeKey{"num_experts_per_tok", r.NumExpertsPerTok, &c.ExpertsPerTok},
		sizeKey{"moe_intermediate_size", r.MoEIntermediateSize, &c.MoEIntermediate},
	)
	if err != nil {
		return err
	}
	c.DecoderSparseStep = 1
	if r.DecoderSparseStep != nil {
		c.DecoderSparseStep = *r.DecoderSparseStep
	}
	if c.DecoderSparseStep <= 0 {
		return errkind.Errorf(ErrConfig, "decoder_sparse_step %d must be positive", c.DecoderSparseStep)
	}
	if c.ExpertsPerTok > c.NumExperts {
		return errkind.Errorf(ErrConfig, "num_experts_per_tok %d exceeds num_experts %d", c.ExpertsPerTok, c.NumExperts)
	}
	for _, l := range r.MLPOnlyLayers {
		if l < 0 || l >= c.Layers {
			return errkind.Errorf(ErrConfig, "mlp_only_layers entry %d outside [0,%d)", l, c.Layers)
		}
	}
	c.MLPOnlyLayers = r.MLPOnlyLayers
	return c.parseRouter(r)
}

// parseRouter reads the options of Qwen3-MoE's router and of its
// load-balancing loss, with the Qwen3MoeConfig defaults.
func (c *Config) parseRouter(r *rawConfig) error {
	c.NormTopKProb = false // Qwen3MoeConfig default
	if r.NormTopKProb != nil {
		c.NormTopKProb = *r.NormTopKProb
	}
	c.RouterAuxLossCoef = 0.001 // Qwen3MoeConfig defaults
	if r.RouterAuxLossCoef != nil {
		c.RouterAuxLossCoef = *r.RouterAuxLossCoef
	}
	if c.RouterAuxLossCoef < 0 || math.IsNaN(c.RouterAuxLossCoef) || math.IsInf(c.RouterAuxLossCoef, 0) {
		return errkind.Errorf(ErrConfig, "router_aux_loss_coef %g must be a finite number >= 0", c.RouterAuxLossCoef)
	}
	if r.OutputRouterLogits != nil {
		c.OutputRouterLogits = *r.OutputRouterLogits
	}
	return nil
}

// parseRopeScaling reads rope_scaling: absent, null or the default rope
// is none; llama3 needs all four of its parameters, in range; any other
// rope_type is refused, since the decoder implements no other.
func (c *Config) parseRopeScaling(raw json.RawMessage) error {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var rs struct {
		RopeType string   `json:"rope_type"`
		Type     string   `json:"type"`
		Factor   *float64 `json:"factor"`
		Low      *float64 `json:"low_freq_factor"`
		High     *float64 `json:"high_freq_factor"`
		Orig     *int     `json:"original_max_position_embeddings"`
	}
	if err := json.Unmarshal(raw, &rs); err != nil {
		return errkind.Errorf(ErrConfig, "rope_scaling: %v", err)
	}
	t := rs.RopeType
	if t == "" {
		t = rs.Type
	}
	switch t {
	case "default", "":
		return nil
	case "llama3":
	default:
		return errkind.Errorf(ErrConfig, "rope_scaling rope_type %q is not supported (only llama3)", t)
	}
	if rs.Factor == nil || rs.Low == nil || rs.High == nil || rs.Orig == nil {
		return errkind.Errorf(ErrConfig, "rope_scaling llama3 needs factor, low_freq_factor, high_freq_factor and original_max_position_embeddings")
	}
	if *rs.Factor <= 0 || *rs.Low <= 0 || *rs.High <= *rs.Low || *rs.Orig <= 0 {
		return errkind.Errorf(ErrConfig, "rope_scaling llama3 needs factor>0, 0<low_freq_factor<high_freq_factor, original_max_position_embeddings>0")
	}
	c.RopeScaling = &RopeScaling{Factor: *rs.Factor, LowFreqFactor: *rs.Low, HighFreqFactor: *rs.High, OriginalMaxPos: *rs.Orig}
	return nil
}

// firstID reads a token id that may be an int, a list of ints or null.
func firstID(raw json.RawMessage) int {
	var one int
	if json.Unmarshal(raw, &one) == nil {
		return one
	}
	var many []int
	if json.Unmarshal(raw, &many) == nil && len(many) > 0 {
		return many[0]
	}
	return -1
}

// JSON renders the config as an HF config.json that transformers loads,
// for BF16 weights.
func (c *Config) JSON() ([]byte, error) { return c.jsonDType("bfloat16") }

// JSONF32 is JSON for F32 weights (a training checkpoint's masters):
// torch_dtype float32, so that transformers' torch_dtype="auto" keeps
// their digits instead of rounding them to BF16.
func (c *Config) JSONF32() ([]byte, error) { return c.jsonDType("float32") }

// jsonDType is JSON with torch_dtype, the weights' dtype as transformers
// names it: torch_dtype="auto" loads them in it.
func (c *Config) jsonDType(torchDType string) ([]byte, error) {
	m := map[string]any{
		"architectures":           []string{hfClass[c.Arch]},
		"model_type":              string(c.Arch),
		"vocab_size":              c.VocabSize,
		"hidden_size":             c.Hidden,
		"num_hidden_layers":       c.Layers,
		"num_attention_heads":     c.Heads,
		"num_key_value_heads":     c.KVHeads,
		"head_dim":                c.HeadDim,
		"intermediate_size":       c.Intermediate,
		"max_position_embeddings": c.MaxPositions,
		"rms_norm_eps":            c.RMSNormEps,
		"rope_theta":              c.RopeTheta,
		"tie_word_embeddings":     c.TieEmbeddings,
		"hidden_act":              "silu",
		"torch_dtype":             torchDType,
		"attention_dropout":       0.0,
		"initializer_range":       0.02,
		"use_cache":               true,
	}
	if c.BOSTokenID >= 0 {
		m["bos_token_id"] = c.BOSTokenID
	}
	if c.EOSTokenID >= 0 {
		m["eos_token_id"] = c.EOSTokenID
	}
	switch c.Arch {
	case ArchLlama:
		m["attention_bias"] = c.AttentionBias
		m["mlp_bias"] = false
		m["pretraining_tp"] = 1
	case ArchQwen2:
		m["use_sliding_window"] = false
		m["sliding_window"] = nil
		m["max_window_layers"] = c.Layers
	case ArchQwen3, ArchQwen3MoE:
		m["attention_bias"] = c.AttentionBias
		m["use_sliding_window"] = false
		m["sliding_window"] = nil
		m["max_window_layers"] = c.Layers
	}
	if c.Arch == ArchQwen3MoE {
		m["num_experts"] = c.NumExperts
		m["num_experts_per_tok"] = c.ExpertsPerTok
		m["moe_intermediate_size"] = c.MoEIntermediate
		m["decoder_sparse_step"] = c.DecoderSparseStep
		m["norm_topk_prob"] = c.NormTopKProb
		m["mlp_only_layers"] = append([]int{}, c.MLPOnlyLayers...)
		m["output_router_logits"] = c.OutputRouterLogits
		m["router_aux_loss_coef"] = c.RouterAuxLossCoef
	}
	if s := c.RopeScaling; s != nil {
		m["rope_scaling"] = map[string]any{
			"rope_type":                        "llama3",
			"factor":                           s.Factor,
			"low_freq_factor":                  s.LowFreqFactor,
			"high_freq_factor":                 s.HighFreqFactor,
			"original_max_position_embeddings": s.OriginalMaxPos,
		}
	}
	return json.MarshalIndent(m, "", "  ")
}
