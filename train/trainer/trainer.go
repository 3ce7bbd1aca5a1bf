// Package trainer runs student training from a teacher cache (KD + SFT),
// or supervised fine-tuning from a dataset with no teacher: it builds the
// student (from an HF checkpoint or a random architecture), packs the
// samples into rows, accumulates gradients to a global batch in tokens,
// steps AdamW on a schedule, evaluates on a held-out sample range, writes
// metrics (JSONL and TensorBoard) and atomic checkpoints, and resumes from
// them bit for bit.
//
// # Run directory
//
//	RUN_DIR/
//	  train.lock                    flock held by the one trainer using the directory (its pid, host, command)
//	  config.yaml                   the resolved config (defaults, overrides, tokenizer fingerprint)
//	  metrics.jsonl                 one JSON object per step ("type":"train") and per eval ("type":"eval");
//	                                NaN and Inf are written as null (a skipped step has "skipped": true)
//	  tb/events.out.tfevents.*      the same scalars for TensorBoard (package tbevent)
//	  checkpoints/step-NNNNNNNN/    the newest checkpoint.keep checkpoints:
//	    config.json                 HF config of the student
//	    model.safetensors           F32 master weights (an HF checkpoint: export and infer read it)
//	    optimizer.safetensors       AdamW moments: exp_avg.<tensor>, exp_avg_sq.<tensor>
//	    state.json                  step, data position, schedule, NVFP4 amax, loss definition (State)
//	  checkpoints/.tmp-step-*       a checkpoint being written (never read; removed on save)
//
// A data-parallel run at ZeRO stages 1 to 3 writes sharded checkpoints
// instead of model.safetensors and optimizer.safetensors: each rank's
// shard-R-of-N.safetensors and a manifest.json (ckptshard.go has the
// layout); checkpoint.layout: gathered keeps the single-process layout.
//
// A run that has nothing left to do (resumed at train.max_steps) changes
// nothing in the run directory.
//
// # Stopping and failing
//
// Options.Stop (SIGTERM and Ctrl-C in `student train`) ends the run at
// the next step boundary: a step in progress is abandoned, having changed
// neither weights nor moments nor data position, and a checkpoint of the
// last finished step is written. A data error in the middle of a run (a
// sample longer than seq_len, an unreadable chunk, a failed eval) writes a
// checkpoint of the last finished step before the error is returned, so
// no work is lost; data.eval_range is checked against the cache's filled
// samples before the first step. A step with a non-finite gradient norm
// skips its update; train.max_skipped_steps consecutive ones end the run
// with ErrDiverged naming the last good checkpoint, which checkpoint
// retention keeps meanwhile.
//
// # Data
//
// A step pulls samples from the cache's seeded, shuffled order (cache
// Reader.Iter with seed+epoch; samples in data.eval_range skipped) until
// it has data.global_batch_tokens tokens, packs them greedily into rows of
// at most data.seq_len tokens (a sample is never split; it opens a new row
// when it does not fit), and runs one forward+backward per row with the
// loss normalized by the step's total count of loss positions, so the
// gradient is that of the mean over the whole global batch, whatever the
// packing. The position in the order is (epoch, samples pulled), which a
// checkpoint stores; resuming replays the order to it.
//
// # Several teachers
//
// data.caches names several teachers' caches over the same samples, each
// with a name and a weight: multi-teacher KD, whose KD term is the weighted
// sum of the teachers' divergences (package loss, Multi-teacher KD). Before
// step 1 every cache is checked against the student (vocabulary,
// tokenizer) and against the first (dataset fingerprint, sample count,
// capture temperature, and every sample the first holds is committed in
// it); each sample's tokens and mask are compared with the first cache's
// as they are read, and a difference is an error naming the sample, the
// position and both caches. The first cache's shuffled order is the
// training order and the data position; the others are read by index.
// The per-teacher KD and top-1 agreement go to metrics.jsonl ("teachers"),
// TensorBoard (train/kd/NAME, train/top1_agreement/NAME, and eval/...) and
// the log lines. A checkpoint records the teachers (name, fingerprint,
// weight): a resume with other teachers or another number of them is
// refused; new weights are allowed and said.
//
// # Datasets (SFT)
//
// data.dataset names files that package data reads and tokenizes exactly
// as `cachectl fill` does (blend weights, column and role mappings, the
// tokenizer's chat template or a file, template variables, max_len with
// truncate or drop, skip_bad), with the student's tokenizer (model.tokenizer
// or model.init_from). There is no teacher: distill.kd_weight must be 0
// (its default with a dataset) and the loss is the cross-entropy on the
// targets of data's masks (assistant turns, responses; completion-only),
// distill.sft_weight defaulting to 1. Epoch e visits the dataset's index in
// the order data.NewOrder(samples, seed+e), skipping data.eval_range and
// the samples data dropped or skipped; the samples are packed into rows as
// a cache's are. A goroutine tokenizes ahead of the step on
// data.dataset.workers goroutines, at most two global batches ahead. The
// checkpoint's data position is (epoch, positions of the order consumed),
// from which a resume starts directly, and the dataset's fingerprint (its
// files' contents, the tokenizer, the template and every option that
// changes tokens), which a resume must match. Evaluation reads
// data.eval_range of the dataset; it has CE and token accuracy, and no
// KD or top-1 agreement.
//
// # Determinism
//
// With the same train.threads, a resumed run reproduces the uninterrupted
// one bit for bit: the kernels reduce in a fixed order for a fixed thread
// count, the optimizer state is saved in full, and the data order is a
// pure function of the seed.
//
// # Tokenizer check
//
// The student's tokenizer fingerprint comes from model.tokenizer_fingerprint,
// else from tokenizer.json in model.tokenizer, else in model.init_from; it
// is recorded in the run's config.yaml and every checkpoint's state.json.
// A cache whose tokenizer fingerprint or vocab_size differs from the
// student's is refused, naming both.
package trainer

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"

	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/compute"
	"distill/compute/device"
	"distill/data/tokenizer"
	"distill/internal/errkind"
	"distill/model"
	"distill/train"
)

// Sentinel errors; every error of this package wraps one of them or an
// error of the package that failed (cache, model, train, loss, optim).
// ErrConfig's, ErrData's and ErrMismatch's text is in the chain only
// (errkind), not in the message: that names the key, the sample or what
// differs, and "trainer: bad config: " in front of it meant nothing to a
// user of `student`. The others' text goes in front of their messages
// and says what happened ("cannot resume: ..."), without the package.
var (
	// ErrConfig marks a bad config key (the message names it).
	ErrConfig = errors.New("trainer: bad config")
	// ErrData marks samples the run cannot use as configured.
	ErrData = errors.New("trainer: bad data")
	// ErrMismatch marks teacher data that does not fit the student or
	// the other teachers: a cache or a live teacher of another tokenizer
	// or vocabulary, caches of other samples. The message names what
	// differs ("cache does not match the student" was wrong for a live
	// teacher and for two caches).
	ErrMismatch = errors.New("trainer: mismatch")
	// ErrResume marks a checkpoint that cannot be resumed by this config.
	ErrResume = errors.New("cannot resume")
	// ErrDiverged marks a run stopped after train.max_skipped_steps
	// consecutive non-finite steps.
	ErrDiverged = errors.New("training diverged")
	// ErrLocked marks a run directory another trainer is using.
	ErrLocked = errors.New("run directory in use")
	// ErrDeviceMemory marks a run the device's memory cannot hold: its
	// memory plan does not fit (checked before step 1), or the device ran
	// out (then it wraps compute.ErrOutOfMemory too).
	ErrDeviceMemory = errors.New("out of device memory")
)

// Options control a run beyond its config.
type Options struct {
	// Log receives log lines and the progress bar; nil means os.Stderr.
	Log io.Writer
	// Resume: "auto" (default) continues from the newest checkpoint in the
	// run directory if there is one, "never" refuses a run directory that
	// has checkpoints, "must" refuses one that has none.
	Resume string
	// StopAfter > 0 ends Run after that many steps of this process without
	// a final checkpoint, as a crash would (tests of resume).
	StopAfter int
	// Stop, when closed, ends the run at the next step boundary: a step
	// in progress is abandoned (its update is not applied), a checkpoint
	// of the last finished step is written, and Run returns with
	// Result.Interrupted set and no error (SIGTERM, Ctrl-C).
	Stop <-chan struct{}
	// Source, when not nil, is the data the run trains and evaluates on
	// instead of the data the config names (data.cache, data.caches,
	// data.dataset, distill.teachers): any implementation of Source.
	Source Source
	// Parallel, when not nil, makes this process one rank of a
	// data-parallel run (see Parallel).
	Parallel *Parallel
}

// StepMetrics are one optimizer step's metrics (a metrics.jsonl line).
// Non-finite values (a skipped step's loss and gradient norm) are written
// as null.
type StepMetrics struct {
	Type         string  `json:"type"` // "train"
	Step         int     `json:"step"`
	Loss         float64 `json:"loss"`
	KD           float64 `json:"kd"`
	CE           float64 `json:"ce"`
	LR           float64 `json:"lr"`
	GradNorm     float64 `json:"grad_norm"`
	Tokens       int     `json:"tokens"`      // tokens consumed by the step
	LossTokens   int     `json:"loss_tokens"` // positions the loss counted
	Rows         int     `json:"rows"`        // packed rows (micro-batches)
	TokensPerSec float64 `json:"tokens_per_s"`
	// DataSeconds is the part of the step spent getting its samples
	// (reading and decoding the cache, or waiting for the dataset's
	// tokenization read-ahead, or for the teachers) and packing them.
	DataSeconds float64 `json:"data_s"`
	// Online KD (distill.teachers): TeacherWaitSeconds is the part of
	// DataSeconds spent waiting for the teachers' answers; QueueDepth
	// the samples in flight ahead of the step (asked or answered) when
	// the step's samples were in.
	TeacherWaitSeconds float64 `json:"teacher_wait_s"`
	QueueDepth         int     `json:"queue_depth"`
	GFLOPs             float64 `json:"gflop_per_s"` // achieved, model FLOPs (see stepFLOPs)
	PeakMemBytes       int64   `json:"peak_mem_bytes"`
	Skipped            bool    `json:"skipped,omitempty"` // non-finite gradient: no update
	Epoch              int     `json:"epoch"`
	WallTime           float64 `json:"wall_time"`
	// Teachers are the per-teacher KD and top-1 agreement of
	// multi-teacher KD (data.caches), in its order.
	Teachers []TeacherMetrics `json:"teachers,omitempty"`
	// MoE students: AuxLoss is HF Qwen3-MoE's load-balancing loss
	// (before router_aux_loss_coef; Loss includes coef·AuxLoss when the
	// student's config has output_router_logits), token-weighted over the
	// step's rows like Loss. ExpertShare is each expert's share of the
	// step's routed (token, slot) choices, pooled over the MoE layers (it
	// sums to 1; 1/num_experts each when balanced), ExpertShareByLayer the
	// same per MoE layer, in layer order.
	AuxLoss            float64     `json:"aux_loss,omitempty"`
	ExpertShare        []float64   `json:"expert_share,omitempty"`
	ExpertShareByLayer [][]float64 `json:"expert_share_by_layer,omitempty"`
}

// expertShares turns summed routing counts (per MoE layer, per expert)
// into StepMetrics' shares.
func expertShares(counts [][]int) (pooled []float64, byLayer [][]float64) {
	if len(counts) == 0 {
		return nil, nil
	}
	pooled = make([]float64, len(counts[0]))
	var all float64
	for _, c := range counts {
		row := make([]float64, len(c))
		var n float64
		for _, v := range c {
			n += float64(v)
		}
		for e, v := range c {
			row[e] = float64(v) / n
			pooled[e] += float64(v)
		}
		all += n
		byLayer = append(byLayer, row)
	}
	for e := range pooled {
		pooled[e] /= all
	}
	return pooled, byLayer
}

// Result summarizes a Run.
type Result struct {
	Steps      []StepMetrics // the steps run by this call
	Evals      []EvalStats
	Checkpoint string // the newest checkpoint written (or resumed from)
	Resumed    string // the checkpoint resumed from, if any
	// Interrupted: Options.Stop ended the run before train.max_steps;
	// Step is the last finished step, saved in Checkpoint.
	Interrupted bool
	Step        int
}

// errStopped ends a step or an eval that Options.Stop abandoned.
var errStopped = errors.New("trainer: stopped")

// Run trains as cfg says and returns the metrics of the steps it ran.
//
// A device backend that runs out of memory panics (its kernels return no
// errors); Run turns that panic into an error that says what to change,
// after run's deferred clean-up (the run directory's lock, the readers,
// the teachers) has run as the panic unwound. Checkpoints already written
// are intact: each is published whole or not at all. Any other panic is
// a bug and propagates.
func Run(cfg *Config, o Options) (res *Result, err error) {
	defer func() {
		r := recover()
		if r == nil {
			return
		}
		if e, ok := r.(error); ok && errors.Is(e, compute.ErrOutOfMemory) {
			res, err = nil, fmt.Errorf("%w: %w: %s", ErrDeviceMemory, e, oomAdvice(cfg))
			return
		}
		panic(r)
	}()
	res, err = runOnce(cfg, o)
	if errors.Is(err, compute.ErrOutOfMemory) && !errors.Is(err, ErrDeviceMemory) {
		err = fmt.Errorf("%w: %w: %s", ErrDeviceMemory, err, oomAdvice(cfg))
	}
	return res, err
}

// oomAdvice says what to change after an out-of-memory error.
func oomAdvice(cfg *Config) string {
	return fmt.Sprintf("the student's parameters, gradients and AdamW moments (fp32) and the activations of one row of data.seq_len %d tokens (train.recompute %s) do not fit the device; `student plan --config FILE --device-memory SIZE` prints the memory plan; set train.recompute: full, lower data.seq_len, or train on a device with more memory (or train.device: cpu); the checkpoints already written in %s are intact",
		cfg.Data.SeqLen, cfg.Train.Recompute, cfg.RunDir)
}

// runOnce is Run without the out-of-memory recovery.
func runOnce(cfg *Config, o Options) (*Result, error) {
	g := guardRunDir(cfg.RunDir)
	res, err := runSteps(cfg, o)
	g.cleanup(res, err)
	return res, err
}

// CheckCache refuses a cache made with another tokenizer or vocabulary
// than the student's, naming both values.
func CheckCache(cfg *model.Config, tokFP string, m *cache.Manifest, where string) error {
	if m.VocabSize != cfg.VocabSize {
		return errkind.Errorf(ErrMismatch, "cache %s has vocab_size %d but the student has %d: the teacher and student must share a vocabulary", where, m.VocabSize, cfg.VocabSize)
	}
	if m.TokenizerFingerprint != tokFP {
		return errkind.Errorf(ErrMismatch, "cache %s was tokenized with tokenizer %s but the student's tokenizer is %s: use the teacher's tokenizer for the student, or rebuild the cache", where, m.TokenizerFingerprint, tokFP)
	}
	return nil
}

// backend opens the compute backend a run trains on: train.device, with
// train.threads CPU workers (0: one per core). The device chooser's line
// (what auto took, and why) goes to log.
func backend(cfg *Config, log io.Writer, ordinal int) (compute.Backend, error) {
	be, err := device.Open(cfg.Train.Device, device.Options{Purpose: device.Training, Threads: cfg.Train.Threads, Ordinal: ordinal,
		Logf: func(format string, args ...any) { fmt.Fprintf(log, format+"\n", args...) }, Setting: "train.device"})
	if err != nil {
		// Its message is a whole sentence naming train.device and the
		// fix: ErrConfig is in its chain, not its text.
		return nil, errkind.Wrap(ErrConfig, err)
	}
	return be, nil
}

// initStudent builds a fresh student as the config says, on be (sh:
// this rank's part of it under ZeRO stages 2 and 3).
func initStudent(cfg *Config, be compute.Backend, sh *train.Sharding) (*train.Student, error) {
	if err := CheckInitFrom(cfg.Model.InitFrom); err != nil {
		return nil, err
	}
	if lc := cfg.TrainLoRA(); lc != nil {
		return newLoRAStudent(cfg, be, *lc)
	}
	if cfg.Model.InitFrom != "" {
		if sh != nil {
			return train.LoadHFSharded(cfg.Model.InitFrom, be, *sh)
		}
		return train.LoadHFOn(cfg.Model.InitFrom, be)
	}
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		return nil, err
	}
	var s *train.Student
	if sh != nil {
		s, err = train.NewShardedStudentOn(mc, be, *sh)
	} else {
		s, err = train.NewStudentOn(mc, be)
	}
	if err != nil {
		return nil, err
	}
	r := cfg.Model.Random
	if err := s.Load(model.Init(mc, model.InitOptions{Seed: r.InitSeed, Std: r.InitStd})); err != nil {
		return nil, err
	}
	return s, nil
}

// CheckInitFrom refuses a model.init_from that is one of this tool's own
// directories but not an HF checkpoint, saying which one to give instead:
// a student train run directory (its checkpoints are), or a LoRA run's
// checkpoint (adapters only: its merged export is a model). Anything else
// ("" included) is left to the checkpoint's loader.
func CheckInitFrom(dir string) error {
	if dir == "" {
		return nil
	}
	if _, err := os.Stat(filepath.Join(dir, "config.json")); err == nil {
		if _, err := os.Stat(filepath.Join(dir, "adapter_config.json")); err == nil && !hasWeights(dir) {
			out := filepath.Clean(dir) // the export beside the run, not among its checkpoints
			if parent := filepath.Dir(out); filepath.Base(parent) == "checkpoints" {
				out = filepath.Dir(parent)
			}
			return errkind.Errorf(ErrConfig, "model.init_from: %s is a LoRA run's checkpoint: it holds the adapters only (adapter_model.safetensors), not a model: export the merged model first (student export --checkpoint %s --format bf16 --out %s-merged) and point model.init_from at that", dir, dir, out)
		}
		return nil
	}
	if _, err := os.Stat(filepath.Join(dir, "config.yaml")); err != nil {
		return nil
	}
	switch ck, err := LatestCheckpoint(dir); {
	case err == nil && ck != "":
		return errkind.Errorf(ErrConfig, "model.init_from: %s is a student train run directory, not a checkpoint: point model.init_from at one of its checkpoints, e.g. %s, or at an export of it (student export)", dir, ck)
	case err == nil:
		return errkind.Errorf(ErrConfig, "model.init_from: %s is a student train run directory with no checkpoint yet: run it until it saves one, then point model.init_from at that checkpoint", dir)
	}
	return nil
}

// hasWeights reports whether dir holds an HF checkpoint's weights
// (model.safetensors, or a sharded one's index).
func hasWeights(dir string) bool {
	for _, f := range []string{"model.safetensors", "model.safetensors.index.json"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return true
		}
	}
	return false
}

// tokenizerFingerprint resolves the student's tokenizer fingerprint (see
// the package doc) and the directory of its tokenizer.json, absolute ("" if
// only the fingerprint is known). model.tokenizer and
// model.tokenizer_fingerprint, when both are set, must agree. With
// neither and a pre-tokenized data.dataset, fp is "": the run's is
// data.PretokenizedFingerprint of the student's vocabulary.
func tokenizerFingerprint(cfg *Config) (fp, dir string, tok *tokenizer.Tokenizer, err error) {
	dir = cfg.Model.Tokenizer
	if dir == "" && cfg.Model.InitFrom != "" {
		if _, err := os.Stat(filepath.Join(cfg.Model.InitFrom, "tokenizer.json")); err == nil {
			dir = cfg.Model.InitFrom
		}
	}
	fp = cfg.Model.TokenizerFingerprint
	if dir == "" {
		if fp == "" && cfg.Data.Dataset != nil && cfg.Data.Dataset.Pretokenized {
			return "", "", nil, nil // the ids' own: the caller knows the vocabulary
		}
		if fp == "" {
			hint := ""
			if cfg.Data.Dataset != nil {
				hint = "; or, if data.dataset's records are pre-tokenized (input_ids), set data.dataset.pretokenized: true"
			}
			return "", "", nil, errkind.Errorf(ErrConfig, "model: the student's tokenizer is unknown; set model.tokenizer (a directory with tokenizer.json) or model.tokenizer_fingerprint (the cache's is printed by `cachectl status`)%s", hint)
		}
		return fp, "", nil, nil
	}
	key := "model.tokenizer"
	if cfg.Model.Tokenizer == "" {
		key = "model.init_from"
	}
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return "", "", nil, errkind.Errorf(ErrConfig, "%s %s: %w", key, dir, err)
	}
	if fp != "" && fp != tk.Fingerprint() {
		return "", "", nil, errkind.Errorf(ErrConfig, "%s %s has tokenizer fingerprint %s but model.tokenizer_fingerprint (given, or recorded by the resumed checkpoint) is %s: they must name the same tokenizer; drop one of them or fix it",
			key, dir, tk.Fingerprint(), fp)
	}
	if abs, err := filepath.Abs(dir); err == nil {
		dir = abs
	}
	return tk.Fingerprint(), dir, tk, nil
}

// dataName describes the data a checkpoint was trained on (a dataset
// has no teacher).
func dataName(teacher, dataset string) string {
	if teacher == "" {
		return fmt.Sprintf("dataset %.12s (no teacher)", dataset)
	}
	return fmt.Sprintf("the cache of teacher %.12s / dataset %.12s", teacher, dataset)
}

// configData describes the data the config names, whose manifest (or a
// dataset's stand-in) is m.
func configData(cfg *Config, m *cache.Manifest) string {
	if cfg.Data.Dataset != nil {
		return fmt.Sprintf("data.dataset is dataset %.12s (its files, the tokenizer, the chat template or an option that changes the tokens differ)", m.DatasetFingerprint)
	}
	if len(cfg.Data.Caches) > 0 {
		return fmt.Sprintf("data.caches[0] is teacher %.12s / dataset %.12s", m.TeacherFingerprint, m.DatasetFingerprint)
	}
	return fmt.Sprintf("data.cache is teacher %.12s / dataset %.12s", m.TeacherFingerprint, m.DatasetFingerprint)
}

// checkArchitecture refuses a resume whose configured architecture
// differs from the checkpoint's (a resume keeps the checkpoint's weights,
// so it would silently train another model than the config says), naming
// the key. An init_from directory that no longer exists is not checked.
func checkArchitecture(cfg *Config, have *model.Config, ckpt string) error {
	var want *model.Config
	prefix := "model.random."
	switch {
	case cfg.Model.Random != nil:
		mc, err := cfg.Model.Random.ModelConfig()
		if err != nil {
			return err
		}
		want = mc
	case cfg.Model.InitFrom != "":
		mc, err := model.LoadConfig(cfg.Model.InitFrom)
		if err != nil {
			return nil
		}
		want, prefix = mc, "model.init_from "+filepath.Join(cfg.Model.InitFrom, "config.json")+": "
	default:
		return nil
	}
	a, err := configMap(have)
	if err != nil {
		return err
	}
	b, err := configMap(want)
	if err != nil {
		return err
	}
	keys := make([]string, 0, len(a))
	for k := range a {
		keys = append(keys, k)
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			keys = append(keys, k)
		}
	}
	// Keys of the YAML first: a derived config.json key (max_window_layers)
	// is named only when nothing the user wrote differs.
	yamlKey := map[string]bool{}
	rt := reflect.TypeOf(RandomModel{})
	for i := 0; i < rt.NumField(); i++ {
		yamlKey[strings.Split(rt.Field(i).Tag.Get("yaml"), ",")[0]] = true
	}
	sort.Slice(keys, func(i, j int) bool {
		if yamlKey[keys[i]] != yamlKey[keys[j]] {
			return yamlKey[keys[i]]
		}
		return keys[i] < keys[j]
	})
	if have.Arch != want.Arch {
		keys = []string{"model_type"}
	}
	for _, k := range keys {
		if reflect.DeepEqual(a[k], b[k]) {
			continue
		}
		key := prefix + k
		if k == "model_type" || k == "architectures" {
			key = prefix + "arch"
			if cfg.Model.Random == nil {
				key = prefix + k
			}
		}
		return fmt.Errorf("%w: %s has %s = %v, the config says %s = %v: a resume keeps the checkpoint's architecture; restore the key or start a new run_dir",
			ErrResume, ckpt, k, jsonText(a[k]), key, jsonText(b[k]))
	}
	return nil
}

func configMap(c *model.Config) (map[string]any, error) {
	js, err := c.JSON()
	if err != nil {
		return nil, err
	}
	var m map[string]any
	return m, json.Unmarshal(js, &m)
}

func jsonText(v any) string {
	if v == nil {
		return "(unset)"
	}
	b, _ := json.Marshal(v)
	return string(b)
}

// writeResolved writes RUN_DIR/config.yaml.
func writeResolved(cfg *Config) error {
	b, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	hdr := []byte("# Resolved config of this run (defaults, file and overrides); `student train --config` accepts it.\n")
	return writeFileSync(filepath.Join(cfg.RunDir, "config.yaml"), append(hdr, b...))
}

// stepFLOPs counts a step's model FLOPs: 6 per weight per token for the
// trunk's matmuls (forward 2, backward 4), the LM head on the counted
// positions only (forward, backward, and the loss's recompute: 8), and
// the attention matmuls over the causal half of each sample (QKᵀ and PV,
// 2 FLOPs per multiply-add, backward twice the forward).
func stepFLOPs(c *model.Config, rows []*train.Batch, counted int) float64 {
	C, q, kv := float64(c.Hidden), float64(c.Heads*c.HeadDim), float64(c.KVHeads*c.HeadDim)
	// Multiply-adds per token of all layers: an MoE layer runs its router
	// and top-k experts (active parameters), a dense one its MLP.
	var perTok float64
	for i := 0; i < c.Layers; i++ {
		perTok += C*(q+2*kv) + q*C
		if c.IsMoE(i) {
			perTok += C*float64(c.NumExperts) + 3*C*float64(c.MoEIntermediate*c.ExpertsPerTok)
		} else {
			perTok += 3 * C * float64(c.Intermediate)
		}
	}
	var f, att float64
	for _, b := range rows {
		f += 6 * perTok * float64(len(b.Tokens))
		for s := 0; s+1 < len(b.Starts); s++ {
			l := float64(b.Starts[s+1] - b.Starts[s])
			att += l * l / 2
		}
	}
	f += 8 * float64(c.VocabSize) * C * float64(counted)
	f += float64(c.Layers) * 12 * att * q
	return f
}

// peakMem is the process's peak resident set (VmHWM), or the Go runtime's
// total obtained memory where /proc is unavailable.
func peakMem() int64 {
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
				f := strings.Fields(v)
				if len(f) >= 1 {
					if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
						return kb << 10
					}
				}
			}
		}
	}
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.Sys)
}

// lockedWriter serializes writes to w: each Write is one whole line or
// message, never interleaved with another goroutine's.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
