package trainer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/compute/device"
	"distill/data"
	"distill/internal/errkind"
	"distill/internal/suggest"
	"distill/model"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
)

// Config is a training run, read from YAML (see examples/train.yaml
// for every key with a comment). Names follow DistillKit / NeMo where they
// have one (kd_loss, temperature, kd_weight, lr, min_lr, warmup_steps,
// max_steps, global_batch_tokens, seq_len).
type Config struct {
	// RunDir holds config.yaml (the resolved config), metrics.jsonl, the
	// TensorBoard events under tb/, and checkpoints/step-NNNNNNNN.
	RunDir string `yaml:"run_dir"`
	// Seed selects the data order (epoch e uses seed+e).
	Seed       uint64           `yaml:"seed"`
	Model      ModelConfig      `yaml:"model"`
	Data       DataConfig       `yaml:"data"`
	Distill    DistillConfig    `yaml:"distill"`
	Optim      OptimConfig      `yaml:"optim"`
	Train      TrainConfig      `yaml:"train"`
	Eval       EvalConfig       `yaml:"eval"`
	Checkpoint CheckpointConfig `yaml:"checkpoint"`
	Log        LogConfig        `yaml:"log"`
	// Quant is "none" or "nvfp4" (quantization-aware distillation).
	Quant string `yaml:"quant"`
	// CalibBatches is how many packed rows calibrate the NVFP4 amax
	// before it is frozen (quant: nvfp4; and a LoRA run's Linears' input
	// amax, for its merged NVFP4 export: 0 skips that).
	CalibBatches int `yaml:"calib_batches"`
}

// ModelConfig says where the student comes from.
type ModelConfig struct {
	// InitFrom is an HF checkpoint directory to start from; else Random.
	InitFrom string       `yaml:"init_from"`
	Random   *RandomModel `yaml:"random"`
	// Tokenizer is a directory with tokenizer.json whose fingerprint must
	// equal the cache's; TokenizerFingerprint gives the fingerprint
	// directly. With neither, init_from's directory is tried.
	Tokenizer            string `yaml:"tokenizer"`
	TokenizerFingerprint string `yaml:"tokenizer_fingerprint"`
	// LoRA, when set, trains low-rank adapters on a frozen base (the
	// model init_from or random gives) instead of every weight.
	LoRA *LoRAModel `yaml:"lora,omitempty"`
}

// LoRAModel is model.lora: PEFT's LoraConfig (r, lora_alpha,
// lora_dropout, target_modules, init_lora_weights) under this config's
// key names.
type LoRAModel struct {
	Rank    int      `yaml:"rank"`
	Alpha   *float64 `yaml:"alpha"`   // absent: 8, PEFT's default
	Dropout float64  `yaml:"dropout"` // lora_dropout p, 0 <= p < 1 (default 0)
	// Targets are HF/PEFT module names; absent: q_proj, v_proj (PEFT's
	// default for Llama and Qwen).
	Targets []string `yaml:"targets"`
	Init    string   `yaml:"init"` // kaiming (default) or gaussian
	Seed    uint64   `yaml:"seed"` // draws A and keys the dropout masks
}

// TrainLoRA is model.lora as package train takes it (defaults applied),
// with quant: nvfp4 holding the base fake-quantized; nil without it.
func (c *Config) TrainLoRA() *train.LoRAConfig {
	l := c.Model.LoRA
	if l == nil {
		return nil
	}
	lc := &train.LoRAConfig{Rank: l.Rank, Alpha: 8, Dropout: l.Dropout, Targets: l.Targets, Init: l.Init, Seed: l.Seed, NVFP4: c.Quant == "nvfp4"}
	if l.Alpha != nil {
		lc.Alpha = *l.Alpha
	}
	if len(lc.Targets) == 0 {
		lc.Targets = []string{"q_proj", "v_proj"}
	}
	if lc.Init == "" {
		lc.Init = "kaiming"
	}
	return lc
}

// RandomModel is the architecture of a randomly initialized student (HF
// config.json names).
type RandomModel struct {
	Arch          string  `yaml:"arch"`
	VocabSize     int     `yaml:"vocab_size"`
	Hidden        int     `yaml:"hidden_size"`
	Layers        int     `yaml:"num_hidden_layers"`
	Heads         int     `yaml:"num_attention_heads"`
	KVHeads       int     `yaml:"num_key_value_heads"`
	HeadDim       int     `yaml:"head_dim"`
	Intermediate  int     `yaml:"intermediate_size"`
	MaxPositions  int     `yaml:"max_position_embeddings"`
	TieEmbeddings bool    `yaml:"tie_word_embeddings"`
	AttentionBias bool    `yaml:"attention_bias"`
	RopeTheta     float64 `yaml:"rope_theta"`
	RMSNormEps    float64 `yaml:"rms_norm_eps"`
	InitStd       float64 `yaml:"init_std"`
	InitSeed      uint64  `yaml:"init_seed"`
	// Qwen3-MoE (arch qwen3_moe); absent: the preset's values.
	NumExperts         int      `yaml:"num_experts"`
	ExpertsPerTok      int      `yaml:"num_experts_per_tok"`
	MoEIntermediate    int      `yaml:"moe_intermediate_size"`
	DecoderSparseStep  int      `yaml:"decoder_sparse_step"`
	NormTopKProb       *bool    `yaml:"norm_topk_prob"`
	MLPOnlyLayers      *[]int   `yaml:"mlp_only_layers"`
	OutputRouterLogits bool     `yaml:"output_router_logits"`
	RouterAuxLossCoef  *float64 `yaml:"router_aux_loss_coef"`
}

// DataConfig is where samples come from (a teacher cache, or a dataset
// for plain SFT) and how they become packed rows.
type DataConfig struct {
	Cache []string `yaml:"cache"`
	// Caches are several teachers' caches over the same samples (the
	// same dataset, tokens and masks, checked sample by sample), for
	// multi-teacher KD: the KD term is Σ weight·KD of each teacher.
	// Instead of Cache; the first one's order is the training order.
	Caches []TeacherCache `yaml:"caches"`
	// Dataset trains on a dataset instead of a cache: supervised
	// fine-tuning with no teacher (distill.kd_weight must be 0).
	Dataset *DatasetConfig `yaml:"dataset"`
	// SeqLen is the packed row length in tokens: samples are concatenated
	// into rows of at most SeqLen tokens, never split.
	SeqLen int `yaml:"seq_len"`
	// GlobalBatchTokens: an optimizer step accumulates rows until this
	// many tokens were consumed.
	GlobalBatchTokens int `yaml:"global_batch_tokens"`
	// Truncate cuts cached samples longer than SeqLen; else they are an
	// error (a dataset's samples are cut by Dataset.MaxLen and Policy).
	Truncate bool `yaml:"truncate"`
	// EvalRange [start, end) of sample indices is held out of training.
	EvalRange []int64 `yaml:"eval_range"`
	// ShuffleWindow is how many cache chunks are shuffled together.
	ShuffleWindow int `yaml:"shuffle_window"`
}

// TeacherCache is one teacher of data.caches.
type TeacherCache struct {
	// Dir is the teacher's cache: one directory, or a list of directories
	// that form one cache (as data.cache).
	Dir Dirs `yaml:"dir"`
	// Name names the teacher in metrics and logs (default t0, t1, ...).
	Name string `yaml:"name"`
	// Weight of its divergence in the KD term (default 1; 0 keeps it in
	// the metrics only).
	Weight *float64 `yaml:"weight"`
	// Targets is the kind of this teacher's cache (default
	// distill.targets): teachers of different kinds mix, a top-k cache
	// beside a sampled one (package loss, Multi-teacher KD).
	Targets string `yaml:"targets,omitempty"`
}

// targets is the kind the run expects of teacher cache t: its own
// targets, else distill.targets, else topk.
func (t *TeacherCache) targets(c *Config) cache.Targets {
	s := t.Targets
	if s == "" {
		s = c.Distill.Targets
	}
	k, _ := cache.ParseTargets(s) // validated
	return k
}

// Dirs are cache directories: a YAML string (one) or a list.
type Dirs []string

// UnmarshalYAML accepts `dir: DIR` and `dir: [DIR, ...]`.
func (d *Dirs) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		var s string
		if err := n.Decode(&s); err != nil {
			return err
		}
		*d = Dirs{s}
		return nil
	}
	var l []string
	if err := n.Decode(&l); err != nil {
		return err
	}
	*d = l
	return nil
}

// teacherName is the name data.caches[i] goes by.
func (t *TeacherCache) teacherName(i int) string {
	if t.Name != "" {
		return t.Name
	}
	return fmt.Sprintf("t%d", i)
}

// weight is data.caches[i].weight, default 1.
func (t *TeacherCache) weight() float64 {
	if t.Weight == nil {
		return 1
	}
	return *t.Weight
}

// validateCaches checks data.caches on its own: each entry's directory,
// name (unique, usable as a metric key) and weight, and that no cache is
// given twice; the caches themselves are checked against each other and
// the student when the run opens them.
func (c *Config) validateCaches() error {
	if err := checkCaches(c.Data.Caches, configCachesKey, true); err != nil {
		return errkind.Wrap(ErrConfig, err)
	}
	var wsum float64
	for i := range c.Data.Caches {
		wsum += c.Data.Caches[i].weight()
	}
	if len(c.Data.Caches) > 0 && wsum == 0 && c.Distill.KDWeight > 0 {
		return errkind.Errorf(ErrConfig, "data.caches: every teacher's weight is 0 with distill.kd_weight %g: there is nothing to distill from; give a teacher a weight > 0 (or set distill.kd_weight: 0)", c.Distill.KDWeight)
	}
	return nil
}

// configCachesKey names entry i of data.caches, or its field, in errors.
func configCachesKey(i int, field string) string {
	if field == "" {
		return fmt.Sprintf("data.caches[%d]", i)
	}
	return fmt.Sprintf("data.caches[%d].%s", i, field)
}

// CheckCachesFlag checks the teachers' caches of a flag (`student eval
// --caches`), as a config's data.caches is checked, its errors naming
// the flag's entries (entry 1, 2, ...) instead of config keys.
func CheckCachesFlag(tcs []TeacherCache, flag string) error {
	return checkCaches(tcs, func(i int, _ string) string { return fmt.Sprintf("%s entry %d", flag, i+1) }, false)
}

// checkCaches checks teachers' caches on their own, naming entry i (or
// its field) by key; weighted is whether the entries carry weights (a
// config's do, a flag's do not), for the advice on a cache given twice.
func checkCaches(tcs []TeacherCache, key func(i int, field string) string, weighted bool) error {
	bad := func(k string, format string, a ...any) error {
		return fmt.Errorf("%s: %s", k, fmt.Sprintf(format, a...))
	}
	seen := map[string]int{}
	for i := range tcs {
		t := &tcs[i]
		if len(t.Dir) == 0 {
			return bad(key(i, "dir"), "required: the teacher's cache directory")
		}
		for _, d := range t.Dir {
			if strings.TrimSpace(d) == "" {
				return bad(key(i, "dir"), "empty path")
			}
		}
		name := t.teacherName(i)
		for _, r := range name {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-' || r == '.') {
				return bad(key(i, "name"), "%q: use letters, digits, '_', '-' and '.' only (it becomes a metrics key)", name)
			}
		}
		if j, ok := seen[name]; ok {
			return bad(key(i, "name"), "%q is also the name of %s (a default name is t<index>): give every teacher its own name", name, key(j, ""))
		}
		seen[name] = i
		w := t.weight()
		if !(w >= 0) || math.IsInf(w, 0) {
			return bad(key(i, "weight"), "%g: want a finite number >= 0 (default 1)", w)
		}
		if _, err := cache.ParseTargets(t.Targets); err != nil {
			return bad(key(i, "targets"), "%q: want topk, sampled or head+sampled (the kind of its cache; default distill.targets)", t.Targets)
		}
	}
	return checkCachesOnce(tcs, key, weighted)
}

// checkCachesOnce refuses a cache directory given to two teachers: the
// same cache twice trained silently as one teacher at the sum of its
// weights, its KD and top-1 agreement reported twice. Directories are
// compared as they resolve (absolute, symlinks followed where they
// exist, and one directory under two names where both exist), so two
// paths to one directory are the same cache.
func checkCachesOnce(tcs []TeacherCache, key func(i int, field string) string, weighted bool) error {
	dirs := make([][]resolvedDir, len(tcs))
	for i := range tcs {
		for _, d := range tcs[i].Dir {
			dirs[i] = append(dirs[i], resolveDir(d))
		}
	}
	// in reports whether every directory of a is one of b's.
	in := func(a, b []resolvedDir) bool {
		for _, x := range a {
			if !slices.ContainsFunc(b, x.same) {
				return false
			}
		}
		return true
	}
	for j := range tcs {
		for i := 0; i < j; i++ {
			for _, d := range dirs[j] {
				k := slices.IndexFunc(dirs[i], d.same)
				if k < 0 {
					continue
				}
				other := ""
				if e := dirs[i][k]; e.path != d.path {
					other = fmt.Sprintf(" (%s)", e.path)
				}
				if !in(dirs[j], dirs[i]) || !in(dirs[i], dirs[j]) {
					return fmt.Errorf("%s: %s is also a directory of %s%s: a directory holds one teacher's fills, so both entries would read that teacher; give each directory to one teacher", key(j, "dir"), d.path, key(i, ""), other)
				}
				fix := "give it once"
				if weighted {
					fix = fmt.Sprintf("give it once (with weight: %g, the sum of both entries' weights, it trains as now)", tcs[i].weight()+tcs[j].weight())
				}
				return fmt.Errorf("%s (%s) is the same cache as %s%s: a cache given twice trains as one teacher at the sum of its weights; %s, or correct the path of the teacher you meant", key(j, ""), d.path, key(i, ""), other, fix)
			}
		}
	}
	return nil
}

// resolvedDir is a cache directory as given and as it resolves.
type resolvedDir struct {
	path string      // as given
	abs  string      // absolute, symlinks followed where it exists
	fi   os.FileInfo // nil where it does not exist (yet)
}

// resolveDir resolves d: filepath.Abs, then filepath.EvalSymlinks where
// d exists.
func resolveDir(d string) resolvedDir {
	r := resolvedDir{path: d, abs: filepath.Clean(d)}
	if a, err := filepath.Abs(d); err == nil {
		r.abs = a
	}
	if e, err := filepath.EvalSymlinks(r.abs); err == nil {
		r.abs = e
	}
	if fi, err := os.Stat(r.abs); err == nil {
		r.fi = fi
	}
	return r
}

// same reports whether r and o are one directory: the same resolved
// path, or the same file where both exist (a bind mount).
func (r resolvedDir) same(o resolvedDir) bool {
	return r.abs == o.abs || r.fi != nil && o.fi != nil && os.SameFile(r.fi, o.fi)
}

// DatasetConfig is a dataset that package data reads and tokenizes as
// `cachectl fill` does; each key is the fill flag of the same name
// (files is --data). Sample i of the dataset is the sample i that a fill
// with the same options would cache.
type DatasetConfig struct {
	// Files are .jsonl, .csv or .parquet files (relative paths are
	// relative to the working directory).
	Files []string `yaml:"files"`
	// Weights blend the files (one per file, any positive scale); none
	// concatenates them.
	Weights []float64 `yaml:"weights"`
	// Format of every file: jsonl, csv or parquet ("": from the extension).
	Format  string        `yaml:"format"`
	Columns ColumnsConfig `yaml:"columns"`
	// Roles renames the dataset's roles, e.g. {human: user, gpt: assistant}.
	Roles map[string]string `yaml:"roles"`
	// ChatTemplate is a file with a Jinja chat template overriding the
	// tokenizer's ("": the tokenizer's, from tokenizer_config.json).
	ChatTemplate string `yaml:"chat_template"`
	// TemplateVars are extra chat-template variables, e.g.
	// {enable_thinking: false}.
	TemplateVars map[string]any `yaml:"template_vars"`
	// MaxLen is the longest sample in tokens (0: data.seq_len); Policy
	// says what happens to a longer one: truncate or drop.
	MaxLen int    `yaml:"max_len"`
	Policy string `yaml:"policy"`
	// SkipBad trains past bad records (counted and reported) instead of
	// failing on the first.
	SkipBad bool `yaml:"skip_bad"`
	// NumSamples is the length of the index (0: all records); a weighted
	// blend repeats a file it exhausts.
	NumSamples int64 `yaml:"num_samples"`
	// Shuffle and Seed permute the records inside the index (which
	// records eval_range holds out); the training order is shuffled
	// anew every epoch by the top-level seed either way.
	Shuffle bool   `yaml:"shuffle"`
	Seed    uint64 `yaml:"seed"`
	// NoEOS stops appending EOS to text and template-less
	// prompt/response records.
	NoEOS bool `yaml:"no_eos"`
	// Workers is the number of tokenization goroutines reading ahead of
	// the step (0: 2); the samples do not depend on it.
	Workers int `yaml:"workers"`
	// Pretokenized marks records that hold input_ids (and loss_mask), as
	// `cachectl fill --pretokenized`: no tokenizer reads them, so the run
	// needs neither model.tokenizer nor model.tokenizer_fingerprint (with
	// neither, the student's tokenizer is "pretokenized:vocab=V", as such
	// a cache records), and the ids are checked against the student's
	// vocab_size (a live teacher's vocab_size must equal it).
	Pretokenized bool `yaml:"pretokenized"`
}

// ColumnsConfig renames the fields records are read from (fill's
// --columns); empty keeps the default name.
type ColumnsConfig struct {
	Messages string `yaml:"messages"`
	Prompt   string `yaml:"prompt"`
	Response string `yaml:"response"`
	System   string `yaml:"system"`
	Text     string `yaml:"text"`
	InputIDs string `yaml:"input_ids"`
	LossMask string `yaml:"loss_mask"`
	Role     string `yaml:"role"`
	Content  string `yaml:"content"`
}

// DistillConfig is the loss (package train/loss).
type DistillConfig struct {
	KDLoss      string  `yaml:"kd_loss" json:"kd_loss"`
	JSDBeta     float64 `yaml:"jsd_beta" json:"jsd_beta"`
	Tail        string  `yaml:"tail" json:"tail"` // bucket, renormalize or zero (package loss)
	Temperature float64 `yaml:"temperature" json:"temperature"`
	ScaleT2     bool    `yaml:"scale_t2" json:"scale_t2"`
	KDWeight    float64 `yaml:"kd_weight" json:"kd_weight"`
	SFTWeight   float64 `yaml:"sft_weight" json:"sft_weight"`
	// Targets is the target kind the run expects of its caches: topk
	// (the default), sampled or head+sampled (cachectl fill --targets);
	// a cache of another kind is refused.
	Targets string `yaml:"targets,omitempty" json:"targets,omitempty"`
	// Online KD against live teacherd daemons (online_config.go).
	OnlineConfig `yaml:",inline" json:"-"`
}

// OptimConfig is AdamW, the LR schedule and clipping (package train/optim).
type OptimConfig struct {
	LR          float64 `yaml:"lr"`
	MinLR       float64 `yaml:"min_lr"`
	Schedule    string  `yaml:"lr_schedule"`
	WarmupSteps int     `yaml:"warmup_steps"`
	WeightDecay float64 `yaml:"weight_decay"`
	Beta1       float64 `yaml:"beta1"`
	Beta2       float64 `yaml:"beta2"`
	Eps         float64 `yaml:"eps"`
	MaxGradNorm float64 `yaml:"max_grad_norm"`
}

// TrainConfig bounds the run.
type TrainConfig struct {
	MaxSteps int `yaml:"max_steps"`
	// Device is the compute backend, as the binaries' --device: auto
	// (default) trains on the GPU when its CUDA backend opens, else on
	// the CPU (the run's log says which and why); cpu; cuda, the GPU or
	// an error (package device).
	Device string `yaml:"device"`
	// Threads fixes the CPU worker count (0: all cores). Results are
	// bit-identical only between runs with the same count.
	Threads int `yaml:"threads"`
	// MaxSkippedSteps stops the run with an error after this many
	// consecutive steps whose update was skipped for a non-finite
	// gradient norm (0: never stop).
	MaxSkippedSteps int `yaml:"max_skipped_steps"`
	// Recompute is the activation recomputation (Megatron-LM's name):
	// none keeps every activation of a row for the backward; selective
	// re-runs each dense MLP's gate/up/SwiGLU in the backward; full keeps
	// only each layer's input and re-runs the layer; auto (default) takes
	// the least recomputation whose memory plan fits the device (none on
	// the CPU). The gradients are the same in every mode.
	Recompute string `yaml:"recompute"`
	// ZeRO is DeepSpeed's ZeRO stage of a data-parallel run: 0 (every
	// rank holds the whole optimizer state), 1 (AdamW's moments are
	// sharded over the ranks: each rank updates its slice of the
	// parameters, then the ranks broadcast their slices), 2 (the
	// gradients too: each layer's are reduce-scattered as its backward
	// makes them) or 3 (the fp32 weights too: each layer's are gathered
	// for its turn; FSDP's FULL_SHARD). See train.Sharding. One process
	// ignores it.
	ZeRO int `yaml:"zero,omitempty"`
	// OverlapComm (DeepSpeed's zero_optimization.overlap_comm; DDP's
	// gradient buckets, FSDP's prefetch) runs a data-parallel run's
	// collectives beside the compute on a backend that can (the CUDA
	// backend's second stream): at ZeRO stages 0 and 1 each layer's
	// all-reduce during the next layers' backward of the step's last row
	// (two layers' gradients more a GPU); at stages 2 and 3 each layer's
	// reduce-scatter during the next layers' backward (one layer's
	// gradients more), and at stage 3 the all-gather of the layer after
	// next during a layer's forward (one layer's weights more). The
	// results are the same bits either way. Default true.
	OverlapComm *bool `yaml:"overlap_comm,omitempty"`
	// SigtermExitStatus is the exit status of `student train` when SIGTERM
	// stopped it and its checkpoint was written: 0 (default), for a
	// preempted cluster job (Slurm sends SIGTERM before it preempts or
	// requeues a job, and requeues it whatever its status; Megatron-LM's
	// exit signal handler exits 0 after its checkpoint too), or 143 (128+SIGTERM,
	// the shell's status for a job a signal ended) for a scheduler that
	// restarts only a failed job, such as a Kubernetes Job (backoffLimit)
	// or a retry loop in a script. Ctrl-C (SIGINT) always exits 130.
	SigtermExitStatus int `yaml:"sigterm_exit_status,omitempty"`
}

// Overlap reports train.overlap_comm (default true).
func (t TrainConfig) Overlap() bool { return t.OverlapComm == nil || *t.OverlapComm }

// EvalConfig is the periodic evaluation on data.eval_range.
type EvalConfig struct {
	Every      int `yaml:"every"`       // steps between evals; 0 = only at the end
	MaxSamples int `yaml:"max_samples"` // 0 = the whole range
	// Cache is a teacher's cache of a dataset (SFT) run's samples: its
	// evals then read the held-out samples from it and score the student
	// against the teacher too (top-1 agreement, KD), as a cache run's do,
	// so an SFT-only student gets the curves its distilled twin has. The
	// cache must hold the same dataset's samples (its fingerprint).
	Cache string `yaml:"cache,omitempty"`
}

// CheckpointConfig is the checkpoint cadence.
type CheckpointConfig struct {
	Every int `yaml:"every"` // steps between checkpoints; the last step always saves
	Keep  int `yaml:"keep"`  // newest checkpoints kept
	// Layout is how a data-parallel run at ZeRO stages 1 to 3 writes its
	// checkpoints: sharded (each rank writes the part of the weights and
	// moments it holds, and rank 0 a manifest; no rank gathers the
	// model), gathered (rank 0 gathers everything into one HF
	// model.safetensors and optimizer.safetensors, 12 bytes of host memory
	// a parameter) or auto ("": sharded). A single process, ZeRO 0 and LoRA
	// runs always write gathered checkpoints. Either layout resumes at any
	// world size and stage.
	Layout string `yaml:"layout,omitempty"`
}

// LogConfig is where metrics go.
type LogConfig struct {
	Every       int    `yaml:"every"`       // steps between log lines when not on a terminal
	TensorBoard bool   `yaml:"tensorboard"` // write tb/events.out.tfevents.*
	Progress    string `yaml:"progress"`    // auto, on, off: the terminal progress bar
}

// Defaults returns a config with every default filled in.
func Defaults() Config {
	return Config{
		Seed: 1,
		Data: DataConfig{SeqLen: 2048, GlobalBatchTokens: 65536, ShuffleWindow: 4},
		Distill: DistillConfig{KDLoss: string(loss.FwdKL), JSDBeta: 0.5, Tail: string(loss.Bucket), Temperature: 1,
			KDWeight: 1},
		Optim: OptimConfig{LR: 1e-4, MinLR: 1e-5, Schedule: string(optim.Cosine), WarmupSteps: 0, WeightDecay: 0.01,
			Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, MaxGradNorm: 1},
		Train:        TrainConfig{MaxSteps: 1000, MaxSkippedSteps: 10, Recompute: "auto"},
		Eval:         EvalConfig{Every: 100},
		Checkpoint:   CheckpointConfig{Every: 100, Keep: 3},
		Log:          LogConfig{Every: 10, TensorBoard: true, Progress: "auto"},
		Quant:        "none",
		CalibBatches: 8,
	}
}

// LoadConfig reads a YAML config over the defaults, applies overrides
// ("key.path=value", the value parsed as YAML), and validates it. An
// unknown key is an error naming the file and line.
func LoadConfig(path string, overrides []string) (*Config, error) {
	return loadConfig(path, overrides, "", false)
}

// LoadConfigAs is LoadConfig whose validation error names the overrides
// as what (the command line as typed: `student train --max-steps 0` is
// the override train.max_steps=0, a --set the user never gave).
func LoadConfigAs(path string, overrides []string, what string) (*Config, error) {
	return loadConfig(path, overrides, what, false)
}

// LoadEvalConfig reads a config for evaluating a checkpoint (`student
// eval`): as LoadConfig, but only the parts evaluation uses are required
// and validated, the distill section and data's cache, seq_len, truncate
// and eval_range. A file holding only `distill:` (and `data:`) is enough,
// a whole training config works too, and with no file (path "") the
// overrides alone are applied over the defaults. Its errors name the
// file as --config FILE.
func LoadEvalConfig(path string, overrides []string) (*Config, error) {
	return loadConfig(path, overrides, "", true)
}

// LoadEvalConfigAs is LoadEvalConfig whose validation error names the
// overrides as what (e.g. "--kd-loss rev_kl over the training run's loss")
// instead of listing them as --set flags: `student eval` puts the run's
// own loss keys before the user's flags, keys the user never typed.
func LoadEvalConfigAs(path string, overrides []string, what string) (*Config, error) {
	return loadConfig(path, overrides, what, true)
}

// loadConfig is LoadConfig (eval: LoadEvalConfig and its validation);
// what, when not "", names the overrides in its error.
func loadConfig(path string, overrides []string, what string, eval bool) (*Config, error) {
	validate := (*Config).Validate
	if eval {
		validate = (*Config).ValidateEval
	}
	var root yaml.Node
	var src []byte // the file's text
	label := path  // the file in errors: eval names its flag
	if eval && path != "" {
		label = "--config " + path
	}
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			if eval {
				var pe *fs.PathError
				if errors.As(err, &pe) {
					err = pe.Err // the label names the file
				}
				return nil, errkind.Errorf(ErrConfig, "%s: %v", label, err)
			}
			return nil, errkind.Errorf(ErrConfig, "%v", err)
		}
		src = b
		if err := yaml.Unmarshal(b, &root); err != nil {
			return nil, errkind.Errorf(ErrConfig, "%s: %v", label, err)
		}
	} else {
		path, label = "(flags)", "(flags)"
	}
	if root.Kind == 0 {
		root = yaml.Node{Kind: yaml.DocumentNode, Content: []*yaml.Node{{Kind: yaml.MappingNode, Tag: "!!map"}}}
	}
	if root.Kind != yaml.DocumentNode || root.Content[0].Kind != yaml.MappingNode {
		return nil, errkind.Errorf(ErrConfig, "%s: the top level must be a mapping of keys", label)
	}
	// The file is checked alone first, so its errors name its own lines,
	// then each override on top of it, so their errors name the flag (the
	// tree re-encoded with the overrides has lines of its own).
	if src != nil && len(root.Content[0].Content) > 0 {
		if err := decodeStrict(&root, src); err != nil {
			return nil, errkind.Errorf(ErrConfig, "%s: %v (keys are listed in examples/train.yaml)", label, err)
		}
	}
	for _, o := range overrides {
		if err := setKey(root.Content[0], o); err != nil {
			return nil, err
		}
		b, err := yaml.Marshal(&root)
		if err != nil {
			return nil, err
		}
		if err := decodeStrict(&root, b); err != nil {
			return nil, errkind.Errorf(ErrConfig, "--set %s: %v (keys are listed in examples/train.yaml)", o, lineRE.ReplaceAllString(err.Error(), ""))
		}
	}
	b, err := yaml.Marshal(&root)
	if err != nil {
		return nil, err
	}
	c := Defaults()
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil {
		return nil, errkind.Errorf(ErrConfig, "%s: %v (keys are listed in examples/train.yaml)", label, err)
	}
	if c.Data.Dataset != nil && len(c.Distill.Teachers) == 0 {
		// SFT on a dataset: the loss weights default to CE alone (a
		// kd_weight the file gives is checked by Validate). Online KD
		// (distill.teachers) keeps the KD defaults.
		if !hasKey(root.Content[0], "distill", "kd_weight") {
			c.Distill.KDWeight = 0
		}
		if !hasKey(root.Content[0], "distill", "sft_weight") {
			c.Distill.SFTWeight = 1
		}
	}
	if err := validate(&c); err != nil {
		where := label
		if len(overrides) > 0 {
			// The flags may be what made it invalid: name them too.
			where = "--set " + strings.Join(overrides, " --set ")
			if what != "" {
				where = what
			}
			// eval's what names its --config already ("--kd-loss kl
			// over --config FILE").
			if path != "(flags)" && !(eval && what != "") {
				where = label + " with " + where
			}
		}
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	return &c, nil
}

// decodeStrict decodes the config tree root, written as src, over the
// defaults as loadConfig does (integers checked, unknown keys refused),
// for its errors alone: they name src's lines.
func decodeStrict(root *yaml.Node, src []byte) error {
	c := Defaults()
	if err := checkKeys(root.Content[0], reflect.TypeOf(c)); err != nil {
		return err
	}
	if err := checkInts(root.Content[0], reflect.TypeOf(c), ""); err != nil {
		return err
	}
	dec := yaml.NewDecoder(bytes.NewReader(src))
	dec.KnownFields(true)
	return dec.Decode(&c)
}

// lineRE matches the "line N: " of a decoder's error.
var lineRE = regexp.MustCompile(`line \d+: `)

// checkKeys refuses the keys the config does not have, naming each by
// its path and line, with the key it most likely meant or else the keys
// its section has (yaml.v3's own error names a Go type instead: "field
// lrr not found in type trainer.OptimConfig"; and a list that decodes
// itself, distill.teachers, dropped unknown keys silently). A type that
// reads its own YAML form is left to it, unless it is a list (its
// entries are walked).
func checkKeys(root *yaml.Node, t reflect.Type) error {
	var bad []string
	walkYAML(root, t, "", yamlVisitor{
		descend: func(t reflect.Type) bool {
			return t.Kind() == reflect.Slice || !reflect.PointerTo(t).Implements(reflect.TypeFor[yaml.Unmarshaler]())
		},
		unknown: func(k *yaml.Node, parent reflect.Type, prefix string) {
			var names []string
			yamlFields(parent, map[string]reflect.Type{}, &names)
			hint := "the top level's keys: " + strings.Join(names, ", ")
			if prefix != "" {
				hint = prefix + "'s keys: " + strings.Join(names, ", ")
			}
			if s := suggest.Closest(k.Value, names); s != "" {
				hint = "did you mean " + dotted(prefix, s) + "?"
			}
			at := ""
			if k.Line > 0 {
				at = fmt.Sprintf("line %d: ", k.Line)
			}
			bad = append(bad, fmt.Sprintf("%sunknown key %s (%s)", at, dotted(prefix, k.Value), hint))
		},
	})
	switch len(bad) {
	case 0:
		return nil
	case 1:
		return errors.New(bad[0])
	}
	return fmt.Errorf("%d unknown keys:\n  %s\n ", len(bad), strings.Join(bad, "\n  "))
}

// yamlVisitor is what walkYAML calls: descend (nil: always) says whether
// to walk into a node of type t; unknown (may be nil) gets each key of a
// struct's mapping that the struct does not have, with the struct's type
// and the mapping's path; leaf (may be nil) every other node that is not
// a struct's mapping or a sequence, with its type and path.
type yamlVisitor struct {
	descend func(t reflect.Type) bool
	unknown func(k *yaml.Node, parent reflect.Type, prefix string)
	leaf    func(n *yaml.Node, t reflect.Type, prefix string)
}

// walkYAML walks the YAML node n along the Go type t that decodes it, for
// the checks before the decoder (checkKeys, checkInts): pointers
// dereferenced, aliases followed, a struct's mapping key by key (an
// inlined struct's keys are its parent's; a merge key's mapping is
// walked as this one), a sequence entry by entry; prefix is n's dotted
// path.
func walkYAML(n *yaml.Node, t reflect.Type, prefix string, v yamlVisitor) {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if v.descend != nil && !v.descend(t) {
		return
	}
	switch {
	case n.Kind == yaml.AliasNode:
		walkYAML(n.Alias, t, prefix, v)
	case t.Kind() == reflect.Struct && n.Kind == yaml.MappingNode:
		fields := map[string]reflect.Type{}
		yamlFields(t, fields, nil)
		for i := 0; i+1 < len(n.Content); i += 2 {
			k := n.Content[i]
			if k.ShortTag() == "!!merge" {
				walkYAML(n.Content[i+1], t, prefix, v)
				continue
			}
			ft, ok := fields[k.Value]
			if !ok {
				if v.unknown != nil {
					v.unknown(k, t, prefix)
				}
				continue
			}
			walkYAML(n.Content[i+1], ft, dotted(prefix, k.Value), v)
		}
	case t.Kind() == reflect.Slice && n.Kind == yaml.SequenceNode:
		for i, e := range n.Content {
			walkYAML(e, t.Elem(), fmt.Sprintf("%s[%d]", prefix, i), v)
		}
	default:
		if v.leaf != nil {
			v.leaf(n, t, prefix)
		}
	}
}

// yamlFields adds the keys of struct type t (an inlined struct's
// included) to fields, with their types, and to names (when not nil) in
// field order.
func yamlFields(t reflect.Type, fields map[string]reflect.Type, names *[]string) {
	for j := 0; j < t.NumField(); j++ {
		f := t.Field(j)
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		switch {
		case !f.IsExported() || name == "-":
		case strings.Contains(opts, "inline"):
			yamlFields(f.Type, fields, names)
		default:
			if name == "" {
				name = strings.ToLower(f.Name)
			}
			fields[name] = f.Type
			if names != nil {
				*names = append(*names, name)
			}
		}
	}
}

// checkInts refuses a non-integer YAML value for an integer key: yaml.v3
// would silently truncate max_steps: 40.5 to 40. It also refuses what
// the decoder would, naming the key and what to write where the
// decoder named neither, or a Go type ("line 6: cannot unmarshal !!str
// `fast` into float64"; "optim: 1": "into trainer.OptimConfig"): a
// float key's value that is not a number, a section's that is a value.
// It walks the mapping n along the struct type t (walkYAML); keys
// unknown to t are left to checkKeys. The first such value is the error.
func checkInts(n *yaml.Node, t reflect.Type, prefix string) error {
	var first error
	walkYAML(n, t, prefix, yamlVisitor{leaf: func(n *yaml.Node, t reflect.Type, prefix string) {
		if first != nil || n.Kind != yaml.ScalarNode || t == reflect.TypeOf(time.Duration(0)) || t == reflect.TypeOf(Timeout(0)) {
			return // a type mismatch the decoder reports; a duration is written "10m"
		}
		at := ""
		if n.Line > 0 {
			at = fmt.Sprintf(" (line %d)", n.Line)
		}
		tag := n.ShortTag()
		switch t.Kind() {
		case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
			reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
			if tag != "!!int" && tag != "!!null" {
				first = fmt.Errorf("%s: %q is not an integer%s: write a whole number", prefix, n.Value, at)
			}
		case reflect.Float32, reflect.Float64:
			if tag != "!!int" && tag != "!!float" && tag != "!!null" {
				first = fmt.Errorf("%s: %q is not a number%s: write one, e.g. 0.9 or 3e-4", prefix, n.Value, at)
			}
		case reflect.Struct:
			// A type that reads its own YAML may take a value, and so may
			// a list's entry: the list may read a shorthand
			// (distill.teachers: [host:7070]).
			if tag != "!!null" && !strings.HasSuffix(prefix, "]") && !reflect.PointerTo(t).Implements(reflect.TypeFor[yaml.Unmarshaler]()) {
				var names []string
				yamlFields(t, map[string]reflect.Type{}, &names)
				first = fmt.Errorf("%s: %q is a value%s, and %s is a section: give its keys (%s's keys: %s)", prefix, n.Value, at, prefix, prefix, strings.Join(names, ", "))
			}
		}
	}})
	return first
}

// hasKey reports whether the mapping m holds the key path (a null value
// counts as absent).
func hasKey(m *yaml.Node, path ...string) bool {
	for _, p := range path {
		for m.Kind == yaml.AliasNode {
			m = m.Alias
		}
		if m.Kind != yaml.MappingNode {
			return false
		}
		var found *yaml.Node
		for i := 0; i+1 < len(m.Content); i += 2 {
			if m.Content[i].Value == p {
				found = m.Content[i+1]
			}
		}
		if found == nil {
			return false
		}
		m = found
	}
	return m.ShortTag() != "!!null"
}

func dotted(prefix, key string) string {
	if prefix == "" {
		return key
	}
	return prefix + "." + key
}

// setKey applies one "a.b.c=value" override to a YAML mapping, creating
// intermediate mappings as needed.
func setKey(m *yaml.Node, kv string) error {
	key, val, ok := strings.Cut(kv, "=")
	if !ok || key == "" {
		return errkind.Errorf(ErrConfig, "override %q: want key.path=value, e.g. optim.lr=3e-4", kv)
	}
	var v yaml.Node
	if err := yaml.Unmarshal([]byte(val), &v); err != nil {
		return errkind.Errorf(ErrConfig, "override %s: value %q is not YAML: %v", key, val, err)
	}
	vn := &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!null", Value: ""}
	if v.Kind == yaml.DocumentNode && len(v.Content) == 1 {
		vn = v.Content[0]
	}
	// Line 0: errors about an override name the key, not a line of the file.
	var unline func(n *yaml.Node)
	unline = func(n *yaml.Node) {
		n.Line, n.Column = 0, 0
		for _, c := range n.Content {
			unline(c)
		}
	}
	unline(vn)
	parts := strings.Split(key, ".")
	for i, p := range parts {
		var found *yaml.Node
		for j := 0; j+1 < len(m.Content); j += 2 {
			if m.Content[j].Value == p {
				found = m.Content[j+1]
				if i == len(parts)-1 {
					m.Content[j+1] = vn
				}
				break
			}
		}
		if i == len(parts)-1 {
			if found == nil {
				m.Content = append(m.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: p}, vn)
			}
			return nil
		}
		if found == nil {
			found = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map"}
			m.Content = append(m.Content, &yaml.Node{Kind: yaml.ScalarNode, Tag: "!!str", Value: p}, found)
		}
		if found.Kind != yaml.MappingNode {
			return errkind.Errorf(ErrConfig, "override %s: %s is not a mapping", key, strings.Join(parts[:i+1], "."))
		}
		m = found
	}
	return nil
}

// LossOptions are the loss options of the config for a cache captured at
// teacherT.
func (c *Config) LossOptions(teacherT float64) loss.Options {
	d := c.Distill
	return loss.Options{Targets: loss.TargetKind(d.Targets), KD: loss.Divergence(d.KDLoss), Beta: d.JSDBeta, Tail: loss.Tail(d.Tail), Temperature: d.Temperature,
		TeacherTemperature: teacherT, ScaleT2: d.ScaleT2, KDWeight: d.KDWeight, SFTWeight: d.SFTWeight}
}

// Schedule is the LR schedule of the config.
func (c *Config) Schedule() optim.Schedule {
	return optim.Schedule{Kind: optim.ScheduleKind(c.Optim.Schedule), Peak: c.Optim.LR, Min: c.Optim.MinLR,
		Warmup: c.Optim.WarmupSteps, Total: c.Train.MaxSteps}
}

// AdamW is the optimizer config.
func (c *Config) AdamW() optim.AdamWConfig {
	return optim.AdamWConfig{Beta1: c.Optim.Beta1, Beta2: c.Optim.Beta2, Eps: c.Optim.Eps, WeightDecay: c.Optim.WeightDecay}
}

// Validate names the first bad key. Checks that need the cache or the
// model (vocab, tokenizer, temperatures) happen when the run opens them.
func (c *Config) Validate() error {
	bad := func(key string, format string, a ...any) error {
		return errkind.Errorf(ErrConfig, "%s: %s", key, fmt.Sprintf(format, a...))
	}
	switch {
	case c.RunDir == "":
		return bad("run_dir", "required (where checkpoints and metrics go)")
	case c.Model.InitFrom == "" && c.Model.Random == nil:
		return bad("model", "set model.init_from (an HF checkpoint directory) or model.random (an architecture)")
	case c.Model.InitFrom != "" && c.Model.Random != nil:
		return bad("model", "set only one of model.init_from and model.random")
	case len(c.Data.Cache) == 0 && len(c.Data.Caches) == 0 && c.Data.Dataset == nil && c.online():
		return bad("distill.teachers", "online KD needs data.dataset: the samples the teachers score (the dataset a cache would be filled from)")
	case len(c.Data.Cache) == 0 && len(c.Data.Caches) == 0 && c.Data.Dataset == nil:
		return bad("data.cache", "required: one or more cache directories (or data.caches, several teachers' caches; or data.dataset, to fine-tune on a dataset without a teacher)")
	case len(c.Data.Cache) > 0 && len(c.Data.Caches) > 0:
		return bad("data", "set only one of data.cache (one teacher's cache) and data.caches (several teachers' caches, each with its dir): move the directory into data.caches")
	case (len(c.Data.Cache) > 0 || len(c.Data.Caches) > 0) && c.Data.Dataset != nil:
		return bad("data", "set only one of data.cache or data.caches (distillation from teachers' caches) and data.dataset (SFT on a dataset, no teacher)")
	case c.Data.SeqLen <= 0:
		return bad("data.seq_len", "%d: want > 0", c.Data.SeqLen)
	case c.Data.GlobalBatchTokens <= 0:
		return bad("data.global_batch_tokens", "%d: want > 0", c.Data.GlobalBatchTokens)
	case len(c.Data.EvalRange) != 0 && (len(c.Data.EvalRange) != 2 || c.Data.EvalRange[0] < 0 || c.Data.EvalRange[1] <= c.Data.EvalRange[0]):
		return bad("data.eval_range", "%s: want [start, end) with 0 <= start < end", yamlInts(c.Data.EvalRange))
	case c.Train.MaxSteps <= 0:
		return bad("train.max_steps", "%d: want > 0", c.Train.MaxSteps)
	case c.Train.Threads < 0:
		return bad("train.threads", "%d: want >= 0", c.Train.Threads)
	case device.Check(c.Train.Device, device.Training) != nil:
		return bad("train.device", "%q: want %s", c.Train.Device, device.Names)
	case c.Train.MaxSkippedSteps < 0:
		return bad("train.max_skipped_steps", "%d: want >= 0 (0 = never stop for skipped steps)", c.Train.MaxSkippedSteps)
	case c.Train.ZeRO < 0 || c.Train.ZeRO > 3:
		return bad("train.zero", "%d: want 0 (no sharding), 1 (AdamW's moments sharded over the ranks), 2 (the gradients too) or 3 (the weights too)", c.Train.ZeRO)
	case c.Train.SigtermExitStatus != 0 && c.Train.SigtermExitStatus != 143:
		return bad("train.sigterm_exit_status", "%d: want 0 (a run SIGTERM stopped after its checkpoint exits as done: Slurm preemption) or 143 (128+SIGTERM: it exits as interrupted, for a scheduler that restarts only a failed job)", c.Train.SigtermExitStatus)
	case c.Train.Recompute != "auto" && c.Train.Recompute != "none" && c.Train.Recompute != "selective" && c.Train.Recompute != "full":
		return bad("train.recompute", "%q: want auto (the least recomputation that fits the device), none, selective or full", c.Train.Recompute)
	case c.Eval.Every < 0 || c.Eval.MaxSamples < 0:
		return bad("eval", "every %d, max_samples %d: want >= 0", c.Eval.Every, c.Eval.MaxSamples)
	case c.Eval.Cache != "" && (c.Data.Dataset == nil || c.online()):
		return bad("eval.cache", "%s: a teacher's cache for the evals of an SFT run on data.dataset; a run on a cache or with live teachers already scores against its teachers: remove it", c.Eval.Cache)
	case c.Eval.Cache != "" && len(c.Data.EvalRange) == 0:
		return bad("eval.cache", "%s: needs data.eval_range, the held-out samples the evals read from it", c.Eval.Cache)
	case c.Checkpoint.Layout != "" && c.Checkpoint.Layout != layoutAuto && c.Checkpoint.Layout != layoutGathered && c.Checkpoint.Layout != layoutSharded:
		return bad("checkpoint.layout", "%q: want auto (sharded when a data-parallel run shards its state: ZeRO 1 to 3), sharded or gathered", c.Checkpoint.Layout)
	case c.Checkpoint.Every < 0 || c.Checkpoint.Keep < 1:
		return bad("checkpoint", "every %d, keep %d: want every >= 0 and keep >= 1", c.Checkpoint.Every, c.Checkpoint.Keep)
	case c.Log.Every <= 0:
		return bad("log.every", "%d: want > 0", c.Log.Every)
	case c.Log.Progress != "auto" && c.Log.Progress != "on" && c.Log.Progress != "off":
		return bad("log.progress", "%q: want auto, on or off", c.Log.Progress)
	case c.Quant != "none" && c.Quant != "nvfp4":
		return bad("quant", "%q: want none or nvfp4", c.Quant)
	case c.Quant == "nvfp4" && c.CalibBatches <= 0:
		return bad("calib_batches", "%d: want > 0 with quant: nvfp4", c.CalibBatches)
	case c.Optim.MaxGradNorm < 0:
		return bad("optim.max_grad_norm", "%g: want >= 0 (0 = no clipping)", c.Optim.MaxGradNorm)
	}
	if err := c.validateOptim(); err != nil {
		return err
	}
	if lc := c.TrainLoRA(); lc != nil {
		if err := lc.Check(nil); err != nil {
			return errkind.Wrap(ErrConfig, err)
		}
		if c.Train.ZeRO >= 2 {
			return bad("train.zero", "%d with model.lora: ZeRO stages 2 and 3 do not shard a LoRA student (its adapters and their moments are small, and its frozen base is held once per rank); use train.zero 0 or 1", c.Train.ZeRO)
		}
	}
	// validateOptim named each key; these stay as the optimizer's own word.
	if err := c.AdamW().Validate(); err != nil {
		return errkind.Wrap(ErrConfig, err)
	}
	if err := c.Schedule().Validate(); err != nil {
		return errkind.Wrap(ErrConfig, err)
	}
	if c.Data.Dataset != nil {
		if err := c.validateDataset(); err != nil {
			return err
		}
	}
	if err := c.validateDistill(); err != nil {
		return err
	}
	if err := c.validateCaches(); err != nil {
		return err
	}
	if err := c.validateOnline(); err != nil {
		return err
	}
	if r := c.Model.Random; r != nil {
		if _, err := r.ModelConfig(); err != nil {
			return err
		}
	}
	return nil
}

// validateDataset checks data.dataset and what SFT on it excludes: a KD
// term (there is no teacher) and data.truncate (max_len cuts samples).
func (c *Config) validateDataset() error {
	bad := func(key string, format string, a ...any) error {
		return errkind.Errorf(ErrConfig, "%s: %s", key, fmt.Sprintf(format, a...))
	}
	d := c.Data.Dataset
	online := len(c.Distill.Teachers) > 0
	switch {
	case c.Distill.KDWeight != 0 && !online:
		return bad("distill.kd_weight", "%g with data.dataset: a dataset has no teacher, so there is no KD term to weigh; "+
			"set distill.kd_weight: 0 (or leave it out) to fine-tune on the dataset's labels, or fill a cache from a teacher (`cachectl fill`) and train on data.cache to distill, or set distill.teachers to distill online from live teachers",
			c.Distill.KDWeight)
	case !online && (!(c.Distill.SFTWeight > 0) || math.IsInf(c.Distill.SFTWeight, 0)):
		return bad("distill.sft_weight", "%g with data.dataset: SFT trains on the labels' cross-entropy alone, so it needs a finite sft_weight > 0 (leave it out for 1)", c.Distill.SFTWeight)
	case c.Data.Truncate:
		return bad("data.truncate", "is for cached samples; a dataset's samples are cut at data.dataset.max_len (policy: truncate or drop): remove data.truncate")
	case len(d.Files) == 0:
		return bad("data.dataset.files", "required: one or more .jsonl, .csv or .parquet files")
	case len(d.Weights) != 0 && len(d.Weights) != len(d.Files):
		return bad("data.dataset.weights", "%d weights for %d files: give one per file (a blend), or none (the files concatenated)", len(d.Weights), len(d.Files))
	case d.Format != "" && d.Format != "jsonl" && d.Format != "csv" && d.Format != "parquet":
		return bad("data.dataset.format", "%q: want jsonl, csv or parquet (or leave it out: from each file's extension)", d.Format)
	case d.Policy != "" && d.Policy != string(data.Truncate) && d.Policy != string(data.Drop):
		return bad("data.dataset.policy", "%q: want truncate or drop", d.Policy)
	case d.MaxLen < 0:
		return bad("data.dataset.max_len", "%d: want 0 (data.seq_len) or a positive token count", d.MaxLen)
	case d.MaxLen > c.Data.SeqLen:
		return bad("data.dataset.max_len", "%d exceeds data.seq_len %d: a sample that long never fits a packed row; lower max_len or raise seq_len (0: seq_len)", d.MaxLen, c.Data.SeqLen)
	case d.NumSamples < 0:
		return bad("data.dataset.num_samples", "%d: want 0 (all records) or a positive count", d.NumSamples)
	case d.Workers < 0:
		return bad("data.dataset.workers", "%d: want >= 0 (0: 2)", d.Workers)
	}
	for i, f := range d.Files {
		if strings.TrimSpace(f) == "" {
			return bad(fmt.Sprintf("data.dataset.files[%d]", i), "empty path")
		}
	}
	for i, w := range d.Weights {
		if !(w > 0) || math.IsInf(w, 0) {
			return bad(fmt.Sprintf("data.dataset.weights[%d]", i), "%g: want a positive number", w)
		}
	}
	cm := d.columnMap()
	for from, to := range d.Roles {
		if strings.TrimSpace(from) == "" || strings.TrimSpace(to) == "" {
			return bad("data.dataset.roles", "%q: %q: want DATASET_ROLE: ROLE, e.g. human: user", from, to)
		}
	}
	if err := cm.Check(); err != nil {
		return errkind.Errorf(ErrConfig, "data.dataset.roles: %w", err)
	}
	if _, err := d.templateVars(); err != nil {
		return err
	}
	if d.Pretokenized && (d.ChatTemplate != "" || len(d.TemplateVars) > 0) {
		return bad("data.dataset.pretokenized", "true with a chat_template or template_vars: pre-tokenized records (input_ids) are not rendered by a template; remove chat_template and template_vars, or pretokenized")
	}
	return nil
}

// columnMap is the dataset's column and role mapping for package data.
func (d *DatasetConfig) columnMap() data.ColumnMap {
	c := d.Columns
	cm := data.ColumnMap{Messages: c.Messages, Prompt: c.Prompt, Response: c.Response, System: c.System, Text: c.Text,
		InputIDs: c.InputIDs, LossMask: c.LossMask, Role: c.Role, Content: c.Content}
	if len(d.Roles) > 0 { // "roles: {}" (a resolved config.yaml) is no mapping, as for fill: same fingerprint
		cm.Roles = d.Roles
	}
	return cm
}

// templateVars are the template variables as `cachectl fill
// --template-var NAME=JSON` gives them: JSON values (numbers are
// float64), so both render and fingerprint alike.
func (d *DatasetConfig) templateVars() (map[string]any, error) {
	if len(d.TemplateVars) == 0 {
		return nil, nil
	}
	b, err := json.Marshal(d.TemplateVars)
	var vars map[string]any
	if err == nil {
		err = json.Unmarshal(b, &vars)
	}
	if err != nil {
		return nil, errkind.Errorf(ErrConfig, "data.dataset.template_vars: %v: want values JSON can hold (strings, numbers, booleans, lists, mappings with string keys)", err)
	}
	return vars, nil
}

// options are the data.Options of the dataset for rows of seqLen tokens
// (Workers from the config, default 2).
func (d *DatasetConfig) options(seqLen int) (data.Options, error) {
	vars, err := d.templateVars()
	if err != nil {
		return data.Options{}, err
	}
	o := data.Options{MaxLen: d.MaxLen, Policy: data.Policy(d.Policy), SkipBad: d.SkipBad, NumSamples: d.NumSamples,
		Shuffle: d.Shuffle, Seed: d.Seed, NoEOS: d.NoEOS, TemplateVars: vars, Workers: d.Workers}
	if o.MaxLen == 0 {
		o.MaxLen = seqLen
	}
	if o.Policy == "" {
		o.Policy = data.Truncate
	}
	if o.Workers == 0 {
		o.Workers = 2
	}
	if d.ChatTemplate != "" {
		b, err := os.ReadFile(d.ChatTemplate)
		if err != nil {
			return data.Options{}, errkind.Errorf(ErrConfig, "data.dataset.chat_template: %v", err)
		}
		o.ChatTemplate = string(b)
	}
	return o, nil
}

// sources are the dataset's files for package data.
func (d *DatasetConfig) sources() []data.Source {
	cm := d.columnMap()
	out := make([]data.Source, len(d.Files))
	for i, f := range d.Files {
		out[i] = data.Source{Path: f, Format: d.Format, Columns: cm}
		if len(d.Weights) > 0 {
			out[i].Weight = d.Weights[i]
		}
	}
	return out
}

// validateDistill checks the distill section on its own. The teacher's
// capture temperature (bucket needs it equal to distill.temperature) is

// validateOptim checks the optim section key by key, naming the key as
// the config spells it (the optimizer's own checks, AdamWConfig.Validate
// and Schedule.Validate, know only their fields' names).
func (c *Config) validateOptim() error {
	o := c.Optim
	bad := func(key, format string, a ...any) error {
		return errkind.Errorf(ErrConfig, "%s: "+format, append([]any{key}, a...)...)
	}
	switch {
	case o.Schedule != string(optim.Constant) && o.Schedule != string(optim.Cosine) && o.Schedule != string(optim.Linear):
		return bad("optim.lr_schedule", "%q: want constant, cosine or linear", o.Schedule)
	case !(o.LR > 0):
		return bad("optim.lr", "%g: want > 0 (e.g. 3e-4)", o.LR)
	case !(o.MinLR >= 0) || o.MinLR > o.LR:
		return bad("optim.min_lr", "%g: want 0 <= min_lr <= optim.lr (%g)", o.MinLR, o.LR)
	case o.WarmupSteps < 0:
		return bad("optim.warmup_steps", "%d: want >= 0", o.WarmupSteps)
	case o.Schedule != string(optim.Constant) && o.WarmupSteps >= c.Train.MaxSteps:
		return bad("optim.warmup_steps", "%d: a %s schedule needs train.max_steps (%d) > warmup_steps: lower it, or use lr_schedule: constant", o.WarmupSteps, o.Schedule, c.Train.MaxSteps)
	case !(o.Beta1 >= 0 && o.Beta1 < 1):
		return bad("optim.beta1", "%g: want 0 <= beta1 < 1 (e.g. 0.9)", o.Beta1)
	case !(o.Beta2 >= 0 && o.Beta2 < 1):
		return bad("optim.beta2", "%g: want 0 <= beta2 < 1 (e.g. 0.95)", o.Beta2)
	case !(o.Eps > 0):
		return bad("optim.eps", "%g: want > 0 (e.g. 1e-8)", o.Eps)
	case !(o.WeightDecay >= 0):
		return bad("optim.weight_decay", "%g: want >= 0", o.WeightDecay)
	}
	return nil
}

// checked when the cache is opened.
func (c *Config) validateDistill() error {
	lo := c.LossOptions(c.Distill.Temperature)
	if err := lo.Validate(); err != nil {
		return errkind.Errorf(ErrConfig, "distill: %w", err)
	}
	// A teacher of data.caches of another kind than distill.targets
	// takes that kind's rules (a sampled one: fwd_kl, no tempering).
	for i := range c.Data.Caches {
		if k := c.Data.Caches[i].targets(c); k != cache.Targets(lo.Targets) && !(lo.Targets == "" && k == cache.TargetsTopK) {
			o := lo
			o.Targets = loss.TargetKind(k)
			if err := o.Validate(); err != nil {
				return errkind.Errorf(ErrConfig, "data.caches[%d].targets %s: distill: %w", i, k, err)
			}
		}
	}
	return nil
}

// yamlInts is v as a config writes it, a YAML flow sequence ("[100,
// 200]"), not as Go prints a slice ("[100 200]"); "none" when empty.
func yamlInts(v []int64) string {
	if len(v) == 0 {
		return "none"
	}
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.FormatInt(x, 10)
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// ValidateEval names the first bad key among those evaluation uses: the
// distill section, data.seq_len, data.eval_range and data.dataset.
func (c *Config) ValidateEval() error {
	switch d := c.Data; {
	case d.SeqLen <= 0:
		return errkind.Errorf(ErrConfig, "data.seq_len: %d: want > 0", d.SeqLen)
	case len(d.EvalRange) != 0 && (len(d.EvalRange) != 2 || d.EvalRange[0] < 0 || d.EvalRange[1] <= d.EvalRange[0]):
		return errkind.Errorf(ErrConfig, "data.eval_range: %s: want [start, end) with 0 <= start < end", yamlInts(d.EvalRange))
	}
	if c.Data.Dataset != nil {
		if err := c.validateDataset(); err != nil {
			return err
		}
	}
	if err := c.validateCaches(); err != nil {
		return err
	}
	return c.validateDistill()
}

// modelConfigErr is an ErrConfig naming key for err, an error of package
// model's config checks (what model says is wrong).
func modelConfigErr(key string, err error) error {
	return errkind.Errorf(ErrConfig, "%s: %w", key, err)
}

// ModelConfig resolves the random architecture over model.Preset(arch).
func (r *RandomModel) ModelConfig() (*model.Config, error) {
	if r.Arch == "" {
		r.Arch = "qwen3"
	}
	cfg, err := model.Preset(model.Arch(r.Arch))
	if err != nil {
		return nil, modelConfigErr("model.random.arch", err)
	}
	for _, f := range []struct {
		key string
		v   float64
	}{
		{"vocab_size", float64(r.VocabSize)}, {"hidden_size", float64(r.Hidden)}, {"num_hidden_layers", float64(r.Layers)},
		{"num_attention_heads", float64(r.Heads)}, {"num_key_value_heads", float64(r.KVHeads)}, {"head_dim", float64(r.HeadDim)},
		{"intermediate_size", float64(r.Intermediate)}, {"max_position_embeddings", float64(r.MaxPositions)},
		{"rope_theta", r.RopeTheta}, {"rms_norm_eps", r.RMSNormEps}, {"init_std", r.InitStd},
		{"num_experts", float64(r.NumExperts)}, {"num_experts_per_tok", float64(r.ExpertsPerTok)},
		{"moe_intermediate_size", float64(r.MoEIntermediate)}, {"decoder_sparse_step", float64(r.DecoderSparseStep)},
	} {
		if f.v < 0 || math.IsNaN(f.v) {
			return nil, errkind.Errorf(ErrConfig, "model.random.%s: %g: want > 0 (or leave it out for the preset's value)", f.key, f.v)
		}
	}
	set := func(dst *int, v int) {
		if v > 0 {
			*dst = v
		}
	}
	set(&cfg.VocabSize, r.VocabSize)
	set(&cfg.Hidden, r.Hidden)
	set(&cfg.Layers, r.Layers)
	set(&cfg.Heads, r.Heads)
	set(&cfg.KVHeads, r.KVHeads)
	set(&cfg.Intermediate, r.Intermediate)
	set(&cfg.MaxPositions, r.MaxPositions)
	if cfg.Arch != model.ArchQwen3MoE && (r.NumExperts != 0 || r.ExpertsPerTok != 0 || r.MoEIntermediate != 0 || r.DecoderSparseStep != 0 ||
		r.NormTopKProb != nil || r.MLPOnlyLayers != nil || r.OutputRouterLogits || r.RouterAuxLossCoef != nil) {
		return nil, errkind.Errorf(ErrConfig, "model.random: MoE keys (num_experts, ..., router_aux_loss_coef) need arch: qwen3_moe, not %s", cfg.Arch)
	}
	set(&cfg.NumExperts, r.NumExperts)
	set(&cfg.ExpertsPerTok, r.ExpertsPerTok)
	set(&cfg.MoEIntermediate, r.MoEIntermediate)
	set(&cfg.DecoderSparseStep, r.DecoderSparseStep)
	if r.NormTopKProb != nil {
		cfg.NormTopKProb = *r.NormTopKProb
	}
	if r.MLPOnlyLayers != nil {
		cfg.MLPOnlyLayers = *r.MLPOnlyLayers
	}
	if cfg.Arch == model.ArchQwen3MoE {
		cfg.OutputRouterLogits = r.OutputRouterLogits
	}
	if r.RouterAuxLossCoef != nil {
		cfg.RouterAuxLossCoef = *r.RouterAuxLossCoef
	}
	if r.HeadDim > 0 {
		cfg.HeadDim = r.HeadDim
	} else if cfg.Arch != model.ArchQwen3 && cfg.Arch != model.ArchQwen3MoE {
		cfg.HeadDim = cfg.Hidden / cfg.Heads
	}
	cfg.TieEmbeddings = r.TieEmbeddings
	cfg.AttentionBias = r.AttentionBias || cfg.Arch == model.ArchQwen2
	if r.RopeTheta > 0 {
		cfg.RopeTheta = r.RopeTheta
	}
	if r.RMSNormEps > 0 {
		cfg.RMSNormEps = float32(r.RMSNormEps)
	}
	cfg.RopeScaling = nil
	js, err := cfg.JSON()
	if err != nil {
		return nil, modelConfigErr("model.random", err)
	}
	out, err := model.ParseConfig(js)
	if err != nil {
		return nil, modelConfigErr("model.random", err)
	}
	return out, nil
}
