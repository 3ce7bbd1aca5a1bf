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
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/compute"
	"distill/compute/device"
	"distill/data"
	"distill/data/tokenizer"
	"distill/internal/atomicfile"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
	"distill/train/tbevent"
)

// Sentinel errors; every error of this package wraps one of them or an
// error of the package that failed (cache, model, train, loss, optim).
var (
	// ErrConfig marks a bad config key (the message names it).
	ErrConfig = errors.New("trainer: bad config")
	// ErrData marks samples the run cannot use as configured.
	ErrData = errors.New("trainer: bad data")
	// ErrMismatch marks a cache made for another tokenizer or vocabulary.
	ErrMismatch = errors.New("trainer: cache does not match the student")
	// ErrResume marks a checkpoint that cannot be resumed by this config.
	ErrResume = errors.New("trainer: cannot resume")
	// ErrDiverged marks a run stopped after train.max_skipped_steps
	// consecutive non-finite steps.
	ErrDiverged = errors.New("trainer: training diverged")
	// ErrLocked marks a run directory another trainer is using.
	ErrLocked = errors.New("trainer: run directory in use")
	// ErrDeviceMemory marks a run the device's memory cannot hold: its
	// memory plan does not fit (checked before step 1), or the device ran
	// out (then it wraps compute.ErrOutOfMemory too).
	ErrDeviceMemory = errors.New("trainer: out of device memory")
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

// runSteps is runOnce without the removal of what a run that never
// started left in its run directory.
func runSteps(cfg *Config, o Options) (*Result, error) {
	if o.Log == nil {
		o.Log = os.Stderr
	}
	// The log has writers besides the loop (the online teachers' pause
	// and resume lines come from their pool's goroutine), and Options.Log
	// need not be safe for concurrent use (a bytes.Buffer in tests).
	o.Log = &lockedWriter{w: o.Log}
	if o.Resume == "" {
		o.Resume = "auto"
	}
	stopped := func() bool {
		select {
		case <-o.Stop:
			return true
		default:
			return false
		}
	}
	// The data source: a cache is opened now (a missing one fails before
	// anything is written); a dataset once its tokenizer is known.
	var (
		rd *cache.Reader
		m  cache.Manifest
		ts *teacherSet // data.caches: several teachers; rd is teacher 0's
	)
	if len(cfg.Data.Caches) > 0 {
		var err error
		if ts, err = openTeachers(cfg.Data.Caches, cfg.Data.ShuffleWindow); err != nil {
			return nil, err
		}
		rd, m = ts.rds[0], ts.ms[0]
	} else if cfg.Data.Dataset == nil {
		var err error
		if rd, err = cache.OpenReader(cfg.Data.Cache...); err != nil {
			return nil, err
		}
		m = rd.Manifest()
	} else {
		for i, f := range cfg.Data.Dataset.Files {
			if _, err := os.Stat(f); err != nil {
				return nil, fmt.Errorf("%w: data.dataset.files[%d]: %v", ErrConfig, i, err)
			}
		}
	}
	if rd != nil {
		takeCacheVocab(cfg, &m, o.Log)
	}
	if err := os.MkdirAll(cfg.RunDir, 0o755); err != nil {
		return nil, err
	}
	// One trainer per run directory: a second one would resume from the
	// first's live checkpoints and remove its checkpoint in progress.
	lock, err := lockRunDir(cfg.RunDir)
	if err != nil {
		return nil, err
	}
	defer lock.unlock()
	res := &Result{}
	// Checkpoints a crashed process was writing: never complete, never read.
	stale, _ := filepath.Glob(filepath.Join(cfg.RunDir, "checkpoints", ".tmp-*"))
	for _, d := range stale {
		os.RemoveAll(d)
	}
	ckpt, err := LatestCheckpoint(cfg.RunDir)
	if err != nil {
		return nil, err
	}
	switch {
	case o.Resume == "never" && ckpt != "":
		return nil, fmt.Errorf("%w: %s already has checkpoints (newest %s); use another run_dir or resume", ErrResume, cfg.RunDir, ckpt)
	case o.Resume == "must" && ckpt == "":
		return nil, fmt.Errorf("%w: %s has no checkpoint to resume from", ErrResume, cfg.RunDir)
	}
	var s *train.Student
	st := &State{DataSeed: cfg.Seed, LRSchedule: cfg.Optim.Schedule, LR: cfg.Optim.LR, MaxSteps: cfg.Train.MaxSteps}
	st.setBatching(cfg)
	st.setLoss(cfg)
	if ckpt != "" {
		be, err := backend(cfg, o.Log)
		if err != nil {
			return nil, err
		}
		if s, st, err = loadCheckpoint(ckpt, be); err != nil {
			return nil, err
		}
		res.Resumed, res.Checkpoint, res.Step = ckpt, ckpt, st.Step
		if st.DataSeed != cfg.Seed {
			return nil, fmt.Errorf("%w: %s was trained with seed %d, the config says %d", ErrResume, ckpt, st.DataSeed, cfg.Seed)
		}
		if (st.QuantAmax != nil) != (cfg.Quant == "nvfp4") {
			return nil, fmt.Errorf("%w: %s has NVFP4 state %v but the config says quant: %s", ErrResume, ckpt, st.QuantAmax != nil, cfg.Quant)
		}
		if err := st.checkBatching(cfg, ckpt); err != nil {
			return nil, err
		}
		if err := checkArchitecture(cfg, s.Cfg, ckpt); err != nil {
			return nil, err
		}
		if err := st.checkLoss(cfg, ckpt, o.Log); err != nil {
			return nil, err
		}
		st.setLoss(cfg)
		if cfg.Model.TokenizerFingerprint == "" {
			cfg.Model.TokenizerFingerprint = st.TokenizerFingerprint
		}
		if st.LRSchedule != cfg.Optim.Schedule || st.LR != cfg.Optim.LR || st.MaxSteps != cfg.Train.MaxSteps {
			fmt.Fprintf(o.Log, "resume: the schedule changed (%s lr %g over %d steps -> %s lr %g over %d steps): the loss curve leaves the uninterrupted run's from here\n",
				st.LRSchedule, st.LR, st.MaxSteps, cfg.Optim.Schedule, cfg.Optim.LR, cfg.Train.MaxSteps)
		}
		st.LRSchedule, st.LR, st.MaxSteps = cfg.Optim.Schedule, cfg.Optim.LR, cfg.Train.MaxSteps
	} else if s, err = initStudent(cfg, o.Log); err != nil {
		return nil, err
	}
	// A device's memory is not the garbage collector's: the run gives
	// back what it allocated, so that a process can run again.
	defer device.Close(s.Backend())
	defer s.Free()
	fp, tokDir, tok, err := tokenizerFingerprint(cfg)
	if err != nil {
		return nil, err
	}
	var (
		ds        *data.Dataset
		dsWorkers int
		on        *online // distill.teachers: the live teachers
	)
	if dc := cfg.Data.Dataset; dc != nil {
		if tok == nil {
			return nil, fmt.Errorf("%w: data.dataset: tokenizing the dataset needs the student's tokenizer: set model.tokenizer (a directory with tokenizer.json and tokenizer_config.json), or model.init_from a directory that has them", ErrConfig)
		}
		if tok.VocabSize() > s.Cfg.VocabSize {
			return nil, fmt.Errorf("%w: the tokenizer %s has %d tokens but the student's vocab_size is %d: token ids past it have no embedding; use a student with vocab_size >= %d",
				ErrMismatch, tokDir, tok.VocabSize(), s.Cfg.VocabSize, tok.VocabSize())
		}
		opts, err := dc.options(cfg.Data.SeqLen)
		if err != nil {
			return nil, err
		}
		dsWorkers = opts.Workers
		st.ChatTemplate = opts.ChatTemplate
		if ds, err = data.Open(dc.sources(), tok, opts); err != nil {
			return nil, fmt.Errorf("data.dataset: %w", err)
		}
		defer ds.Close()
		m = cache.Manifest{DatasetFingerprint: ds.Fingerprint(), Samples: ds.Len(), VocabSize: s.Cfg.VocabSize, TokenizerFingerprint: fp}
		fmt.Fprintf(o.Log, "dataset: %d samples from %s (fingerprint %.12s)\n", ds.Len(), strings.Join(dc.Files, ", "), ds.Fingerprint())
		if cfg.online() {
			// Online KD: every replica's Info is checked before step 1;
			// the teacher then stands where a cache's manifest would.
			if on, err = startOnline(cfg, s.Cfg, fp, opts.MaxLen, &m, o.Log); err != nil {
				return nil, err
			}
			defer on.close()
		}
	}
	// The teachers of a multi-teacher run (data.caches, or several
	// distill.teachers): the checkpoints record them, and the metrics
	// name them.
	var (
		tcur   []TeacherState
		tsrc   string
		twhere func(int) string
	)
	if ts != nil {
		tcur, tsrc, twhere = ts.states(), "data.caches", ts.where
	} else if on != nil {
		tcur, tsrc, twhere = on.states(), "distill.teachers", on.where
	}
	if ckpt != "" {
		if err := st.checkTeachers(tcur, tsrc, twhere, ckpt, o.Log); err != nil {
			return nil, err
		}
	}
	st.setTeachers(tcur)
	if ckpt == "" {
		st.CacheTeacher, st.CacheDataset = m.TeacherFingerprint, m.DatasetFingerprint
	} else if st.CacheTeacher != m.TeacherFingerprint || st.CacheDataset != m.DatasetFingerprint {
		return nil, fmt.Errorf("%w: %s was trained on %s, %s: resume on the same data or start a new run_dir",
			ErrResume, ckpt, dataName(st.CacheTeacher, st.CacheDataset), configData(cfg, &m))
	}
	cfg.Model.TokenizerFingerprint, st.TokenizerFingerprint = fp, fp
	if tokDir != "" {
		st.TokenizerDir = tokDir
	}
	if cfg.Model.InitFrom != "" {
		if abs, err := filepath.Abs(cfg.Model.InitFrom); err == nil {
			st.InitFrom = abs
		}
	}
	if ts != nil {
		if err := ts.check(s.Cfg, fp); err != nil {
			return nil, err
		}
	} else if rd != nil {
		if err := CheckCache(s.Cfg, fp, &m, strings.Join(cfg.Data.Cache, ",")); err != nil {
			return nil, err
		}
	}
	if cfg.Data.SeqLen > s.Cfg.MaxPositions {
		return nil, fmt.Errorf("%w: data.seq_len %d exceeds the student's max_position_embeddings %d", ErrConfig, cfg.Data.SeqLen, s.Cfg.MaxPositions)
	}
	teacherT := float64(m.Temperature)
	if ds != nil && on == nil {
		teacherT = cfg.Distill.Temperature // no teacher: only CE counts
	}
	lopt := cfg.LossOptions(teacherT)
	if err := lopt.Validate(); err != nil {
		return nil, fmt.Errorf("%w: distill (cache captured at temperature %g): %w", ErrConfig, m.Temperature, err)
	}
	held := cache.Range{Start: -1, End: -1}
	evalRange := held
	if len(cfg.Data.EvalRange) == 2 {
		held = cache.Range{Start: cfg.Data.EvalRange[0], End: cfg.Data.EvalRange[1]}
		if held.End > m.Samples {
			what := "cache's"
			if ds != nil {
				what = "dataset's"
			}
			return nil, fmt.Errorf("%w: data.eval_range %v is past the %s %d samples", ErrConfig, cfg.Data.EvalRange, what, m.Samples)
		}
		evalRange = held
		if cfg.Eval.MaxSamples > 0 {
			evalRange.End = min(evalRange.End, evalRange.Start+int64(cfg.Eval.MaxSamples))
		}
		// Every eval reads all of evalRange: a sample the cache lacks
		// would fail the first eval, after the run's first steps and
		// possibly before any checkpoint.
		if ts != nil {
			for i, r := range ts.rds {
				if err := checkFilled(r, evalRange, ts.where(i)); err != nil {
					return nil, err
				}
			}
		} else if rd != nil {
			if err := checkFilled(rd, evalRange, strings.Join(cfg.Data.Cache, ",")); err != nil {
				return nil, err
			}
		}
	}
	// openStream starts the training order at a data position.
	openStream := func(epoch int, pos int64) (sampleStream, error) {
		if on != nil {
			return on.stream(ds, cfg, held, dsWorkers, epoch, pos)
		}
		if ds != nil {
			// Read ahead two global batches (at least two rows).
			limit := max(2*cfg.Data.GlobalBatchTokens, 2*cfg.Data.SeqLen)
			return newDSStream(ds, cfg.Seed, held, dsWorkers, limit, epoch, pos)
		}
		return newStream(rd, cfg.Seed, cfg.Data.ShuffleWindow, held, epoch, pos)
	}
	if st.Step >= cfg.Train.MaxSteps {
		// A no-op run leaves the run directory as it is: its config.yaml
		// still describes the run that made its checkpoints.
		fmt.Fprintf(o.Log, "nothing to do: %s is at step %d of train.max_steps %d\n", cfg.RunDir, st.Step, cfg.Train.MaxSteps)
		return res, nil
	}
	ad, err := optim.NewAdamW(cfg.AdamW(), s.Groups())
	if err != nil {
		return nil, err
	}
	defer ad.Free()
	if ckpt != "" {
		if err := loadMoments(ckpt, ad, st.OptSteps); err != nil {
			return nil, err
		}
	}
	rc, err := planRecompute(cfg, s, planK(&m, ts), decoder.Recompute(st.Recompute), o.Log)
	if err != nil {
		return nil, err
	}
	if err := s.Model.SetRecompute(rc); err != nil {
		return nil, err
	}
	st.Recompute = string(rc)
	pk := &packer{seqLen: cfg.Data.SeqLen, truncate: cfg.Data.Truncate, k: m.K}
	if ts != nil {
		pk.multi, pk.more = ts.teachers(), ts.more
	} else if on != nil && on.multi() {
		pk.multi = on.teachers() // the online stream carries the other teachers' top-k
	}
	if ckpt == "" && cfg.Quant == "nvfp4" {
		if err := calibrate(s, cfg, openStream, pk, &lopt, o.Log); err != nil {
			return nil, err
		}
		st.QuantAmax = s.QuantAmax()
	}
	if err := writeResolved(cfg); err != nil {
		return nil, err
	}
	mw, err := openMetrics(cfg, st.Step)
	if err != nil {
		return nil, err
	}
	defer mw.close()
	stream, err := openStream(st.Epoch, st.EpochPos)
	if err != nil {
		return nil, err
	}
	defer stream.close()
	if ds != nil {
		defer func() {
			fmt.Fprintf(o.Log, "dataset: tokenized %s (training read-ahead and evals together)\n", statsLine(ds.Stats()))
		}()
	}
	if ckpt != "" {
		fmt.Fprintf(o.Log, "resumed from %s at step %d (epoch %d, sample %d of its order)\n", ckpt, st.Step, st.Epoch, st.EpochPos)
	}
	prog := newProgress(o.Log, cfg.Log.Progress, cfg.Log.Every, cfg.Train.MaxSteps)
	prog.sft = ds != nil && on == nil
	sched := cfg.Schedule()
	doEval := func(step int) error {
		if evalRange.Start < 0 {
			return nil
		}
		var es EvalStats
		if ds != nil {
			ss, err := dsEvalSamples(ds, evalRange)
			var more map[int64][]teacherTopK
			if err == nil && on != nil {
				ss, more, err = on.evalSamples(ss)
			}
			if err != nil {
				return err
			}
			epk := *pk
			if more != nil {
				epk.more = func(s cache.Sample) ([]teacherTopK, error) { return more[s.Index], nil }
			}
			rows, n, err := epk.packRows(len(ss), func(k int) (cache.Sample, error) { return ss[k], nil })
			if err != nil {
				return err
			}
			if es, err = evaluateRows(s, rows, n, &lopt, stopped); err != nil {
				return err
			}
			for i := range es.Teachers {
				es.Teachers[i].Name, es.Teachers[i].Weight = tcur[i].Name, tcur[i].Weight
			}
		} else if ts != nil {
			if es, err = evaluateTeachers(s, ts, evalRange, cfg.Data.SeqLen, cfg.Data.Truncate, &lopt, stopped); err != nil {
				return err
			}
		} else if es, err = evaluate(s, rd, evalRange, cfg.Data.SeqLen, cfg.Data.Truncate, &lopt, stopped); err != nil {
			return err
		}
		res.Evals = append(res.Evals, es)
		prog.clear()
		if ds != nil && on == nil {
			fmt.Fprintf(o.Log, "eval step %d: ce %.4f token_acc %.4f (%d tokens, %d samples)\n", step, es.CE, es.TokenAccuracy, es.Tokens, es.Samples)
		} else {
			fmt.Fprintf(o.Log, "eval step %d: loss %.4f kd %.4f ce %.4f token_acc %.4f top1_agree %.4f%s (%d tokens)\n", step, es.Loss, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement, teachersLine(es.Teachers), es.Tokens)
		}
		return mw.eval(step, es)
	}
	// saved is the step of the newest checkpoint on disk; good the step of
	// the newest one not taken in a run of skipped updates (checkpoint
	// retention keeps it, so the error of max_skipped_steps can name it).
	saved, good := st.Step, st.Step
	if ckpt == "" {
		good = -1
	}
	lastGood, skipRun := st.Step, 0
	save := func() error {
		// Metrics first: a checkpoint never refers to lines not on disk.
		if err := mw.flush(); err != nil {
			return err
		}
		protect := -1
		if good >= 0 {
			protect = good
		}
		if skipRun == 0 {
			protect = st.Step
		}
		p, err := saveCheckpoint(cfg.RunDir, s, ad, st, cfg.Checkpoint.Keep, protect)
		if err != nil {
			return err
		}
		res.Checkpoint, saved = p, st.Step
		if skipRun == 0 {
			good = st.Step
		}
		return nil
	}
	// fail ends the run on err after a checkpoint of the last finished
	// step, when there is one to write: the weights, moments and data
	// position of st are consistent at every point where fail is called
	// (an abandoned step has changed none of them).
	fail := func(err error) (*Result, error) {
		prog.clear()
		if st.Step > saved {
			if serr := save(); serr != nil {
				return res, fmt.Errorf("%w (and the checkpoint of step %d failed: %v)", err, st.Step, serr)
			}
			return res, fmt.Errorf("%w\n(step %d saved in %s: fix the cause, then rerun the same command to resume)", err, st.Step, res.Checkpoint)
		}
		return res, err
	}
	interrupt := func() (*Result, error) {
		prog.clear()
		res.Interrupted, res.Step = true, st.Step
		if st.Step > saved {
			if err := save(); err != nil {
				return res, err
			}
		}
		return res, nil // the caller says why it stopped and how to resume
	}
	ran := 0
	for step := st.Step + 1; step <= cfg.Train.MaxSteps; step++ {
		if stopped() {
			return interrupt()
		}
		t0 := time.Now()
		rows, err := pk.nextStep(stream, cfg.Data.GlobalBatchTokens)
		if err != nil {
			return fail(fmt.Errorf("step %d: %w", step, err))
		}
		dataT := time.Since(t0).Seconds()
		var sm StepMetrics
		if ost, ok := stream.(*onlineStream); ok {
			w, depth := ost.stats()
			sm.TeacherWaitSeconds, sm.QueueDepth = w.Seconds(), depth
		}
		total, tokens := 0, 0
		for _, b := range rows {
			total += counted(b)
			tokens += len(b.Tokens)
		}
		s.ZeroGrad()
		var routed [][]int // MoE: per layer and expert, the step's choices
		for i, b := range rows {
			if testHookRow != nil {
				testHookRow(step, i)
			}
			if stopped() {
				fmt.Fprintf(o.Log, "step %d abandoned (row %d of %d)\n", step, i, len(rows))
				return interrupt()
			}
			bs, err := s.ForwardBackward(b, &lopt, float64(total))
			if err != nil {
				return fail(fmt.Errorf("step %d: %w", step, err))
			}
			w := float64(bs.Tokens)
			sm.Loss += bs.Loss * w
			sm.KD += bs.KD * w
			sm.CE += bs.CE * w
			if tcur != nil && sm.Teachers == nil {
				sm.Teachers = make([]TeacherMetrics, len(tcur))
			}
			for i, t := range bs.Teachers {
				sm.Teachers[i].KD += t.KD * w
				sm.Teachers[i].Top1 += t.Top1 * w
			}
			sm.AuxLoss += bs.Aux * w
			for l, c := range s.Routing().Counts {
				if l == len(routed) {
					routed = append(routed, make([]int, len(c)))
				}
				for e, v := range c {
					routed[l][e] += v
				}
			}
		}
		if total > 0 {
			sm.Loss, sm.KD, sm.CE = sm.Loss/float64(total), sm.KD/float64(total), sm.CE/float64(total)
			sm.AuxLoss /= float64(total)
			for i := range sm.Teachers {
				sm.Teachers[i].KD /= float64(total)
				sm.Teachers[i].Top1 /= float64(total)
			}
		}
		for i := range sm.Teachers {
			sm.Teachers[i].Name, sm.Teachers[i].Weight = tcur[i].Name, tcur[i].Weight
		}
		sm.ExpertShare, sm.ExpertShareByLayer = expertShares(routed)
		sm.GradNorm = optim.ClipGradNorm(ad.Groups, cfg.Optim.MaxGradNorm)
		sm.LR = sched.LR(step)
		if math.IsNaN(sm.GradNorm) || math.IsInf(sm.GradNorm, 0) {
			// One bad batch must not poison the weights: skip the update,
			// say so, and let the run go on (the moments are untouched).
			sm.Skipped = true
			skipRun++
			prog.clear()
			if prog.sft {
				fmt.Fprintf(o.Log, "step %d: gradient norm %g (loss %g, ce %g): update skipped\n", step, sm.GradNorm, sm.Loss, sm.CE)
			} else {
				fmt.Fprintf(o.Log, "step %d: gradient norm %g (loss %g, kd %g, ce %g): update skipped\n", step, sm.GradNorm, sm.Loss, sm.KD, sm.CE)
			}
		} else {
			ad.Step(sm.LR)
			skipRun, lastGood = 0, step
		}
		st.Step, st.OptSteps, st.Tokens = step, ad.Steps, st.Tokens+int64(tokens)
		st.Epoch, st.EpochPos = stream.position()
		dt := time.Since(t0).Seconds()
		sm.Type, sm.Step, sm.Tokens, sm.LossTokens, sm.Rows, sm.Epoch = "train", step, tokens, total, len(rows), st.Epoch
		sm.DataSeconds = dataT
		sm.TokensPerSec = float64(tokens) / dt
		sm.GFLOPs = stepFLOPs(s.Cfg, rows, total) / dt / 1e9
		sm.PeakMemBytes = peakMem()
		sm.WallTime = float64(time.Now().UnixNano()) / 1e9
		res.Steps = append(res.Steps, sm)
		res.Step = step
		if err := mw.train(sm); err != nil {
			return fail(err)
		}
		prog.step(sm)
		ran++
		if o.StopAfter > 0 && ran == o.StopAfter {
			return res, nil
		}
		if limit := cfg.Train.MaxSkippedSteps; limit > 0 && skipRun >= limit {
			prog.clear()
			if err := mw.flush(); err != nil {
				return res, err
			}
			where := "there is no checkpoint before them: start a new run"
			if good >= 0 {
				where = fmt.Sprintf("the last good checkpoint is %s (newer ones hold the same weights at a later data position)", checkpointDir(cfg.RunDir, good))
			}
			return res, fmt.Errorf("%w: steps %d to %d: %d consecutive updates skipped for a non-finite gradient norm (train.max_skipped_steps %d); the weights are those of step %d, and %s; lower optim.lr, set optim.max_grad_norm, or check the data of these steps",
				ErrDiverged, step-skipRun+1, step, skipRun, limit, lastGood, where)
		}
		last := step == cfg.Train.MaxSteps
		if (cfg.Eval.Every > 0 && step%cfg.Eval.Every == 0) || last {
			if err := doEval(step); err != nil {
				if errors.Is(err, errStopped) {
					fmt.Fprintf(o.Log, "eval of step %d abandoned\n", step)
					return interrupt()
				}
				return fail(fmt.Errorf("eval at step %d: %w", step, err))
			}
		}
		if (cfg.Checkpoint.Every > 0 && step%cfg.Checkpoint.Every == 0) || last {
			if err := save(); err != nil {
				return res, err
			}
		}
	}
	prog.clear()
	fmt.Fprintf(o.Log, "done: step %d, checkpoint %s\n", st.Step, res.Checkpoint)
	return res, nil
}

// testHookRow, when set (tests), runs before each row of a step.
var testHookRow func(step, row int)

// CheckCache refuses a cache made with another tokenizer or vocabulary
// than the student's, naming both values.
func CheckCache(cfg *model.Config, tokFP string, m *cache.Manifest, where string) error {
	if m.VocabSize != cfg.VocabSize {
		return fmt.Errorf("%w: cache %s has vocab_size %d but the student has %d: the teacher and student must share a vocabulary", ErrMismatch, where, m.VocabSize, cfg.VocabSize)
	}
	if m.TokenizerFingerprint != tokFP {
		return fmt.Errorf("%w: cache %s was tokenized with tokenizer %s but the student's tokenizer is %s: use the teacher's tokenizer for the student, or rebuild the cache", ErrMismatch, where, m.TokenizerFingerprint, tokFP)
	}
	return nil
}

// backend opens the compute backend a run trains on: train.device, with
// train.threads CPU workers (0: one per core). The device chooser's line
// (what auto took, and why) goes to log.
func backend(cfg *Config, log io.Writer) (compute.Backend, error) {
	be, err := device.Open(cfg.Train.Device, device.Options{Purpose: device.Training, Threads: cfg.Train.Threads,
		Logf: func(format string, args ...any) { fmt.Fprintf(log, format+"\n", args...) }})
	if err != nil {
		return nil, fmt.Errorf("%w: train.device: %w", ErrConfig, err)
	}
	return be, nil
}

// initStudent builds a fresh student as the config says.
func initStudent(cfg *Config, log io.Writer) (*train.Student, error) {
	be, err := backend(cfg, log)
	if err != nil {
		return nil, err
	}
	if cfg.Model.InitFrom != "" {
		return train.LoadHFOn(cfg.Model.InitFrom, be)
	}
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		return nil, err
	}
	s, err := train.NewStudentOn(mc, be)
	if err != nil {
		return nil, err
	}
	r := cfg.Model.Random
	if err := s.Load(model.Init(mc, model.InitOptions{Seed: r.InitSeed, Std: r.InitStd})); err != nil {
		return nil, err
	}
	return s, nil
}

// tokenizerFingerprint resolves the student's tokenizer fingerprint (see
// the package doc) and the directory of its tokenizer.json, absolute ("" if
// only the fingerprint is known). model.tokenizer and
// model.tokenizer_fingerprint, when both are set, must agree.
func tokenizerFingerprint(cfg *Config) (fp, dir string, tok *tokenizer.Tokenizer, err error) {
	dir = cfg.Model.Tokenizer
	if dir == "" && cfg.Model.InitFrom != "" {
		if _, err := os.Stat(filepath.Join(cfg.Model.InitFrom, "tokenizer.json")); err == nil {
			dir = cfg.Model.InitFrom
		}
	}
	fp = cfg.Model.TokenizerFingerprint
	if dir == "" {
		if fp == "" {
			return "", "", nil, fmt.Errorf("%w: model: the student's tokenizer is unknown; set model.tokenizer (a directory with tokenizer.json) or model.tokenizer_fingerprint (the cache's is printed by `cachectl status`)", ErrConfig)
		}
		return fp, "", nil, nil
	}
	key := "model.tokenizer"
	if cfg.Model.Tokenizer == "" {
		key = "model.init_from"
	}
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return "", "", nil, fmt.Errorf("%w: %s %s: %w", ErrConfig, key, dir, err)
	}
	if fp != "" && fp != tk.Fingerprint() {
		return "", "", nil, fmt.Errorf("%w: %s %s has tokenizer fingerprint %s but model.tokenizer_fingerprint (given, or recorded by the resumed checkpoint) is %s: they must name the same tokenizer; drop one of them or fix it",
			ErrConfig, key, dir, tk.Fingerprint(), fp)
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

// checkFilled refuses an eval range that is not all committed in the
// cache, naming the missing samples.
func checkFilled(rd *cache.Reader, r cache.Range, where string) error {
	for _, g := range rd.Missing() {
		lo, hi := max(g.Start, r.Start), min(g.End, r.End)
		if lo < hi {
			return fmt.Errorf("%w: data.eval_range: the eval reads samples %v, but samples %v are not in cache %s (not filled yet: `cachectl status` lists the missing ranges): fill them, or move data.eval_range (or lower eval.max_samples) into the filled samples",
				ErrConfig, r, cache.Range{Start: lo, End: hi}, where)
		}
	}
	return nil
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

// calibrate switches NVFP4 QAD on and calibrates the amax on the first
// calib_batches packed rows of the training order (a separate pass over
// the order, so training then sees the same data with or without QAD).
func calibrate(s *train.Student, cfg *Config, open func(epoch int, pos int64) (sampleStream, error), pk *packer, lopt *loss.Options, log io.Writer) error {
	if err := s.EnableQAD(); err != nil {
		return err
	}
	cs, err := open(0, 0)
	if err != nil {
		return err
	}
	defer cs.close()
	n := 0
	for n < cfg.CalibBatches {
		rows, err := pk.nextStep(cs, cfg.Data.SeqLen)
		if err != nil {
			return fmt.Errorf("NVFP4 calibration: %w", err)
		}
		for _, b := range rows {
			if n == cfg.CalibBatches {
				break
			}
			if _, err := s.Forward(b, lopt); err != nil {
				return fmt.Errorf("NVFP4 calibration: %w", err)
			}
			n++
		}
	}
	if err := s.FinishCalibration(); err != nil {
		return err
	}
	fmt.Fprintf(log, "NVFP4: calibrated amax on %d rows, frozen\n", n)
	return nil
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

// metrics writes metrics.jsonl and the TensorBoard events.
type metrics struct {
	f  *os.File
	w  *bufio.Writer
	tb *tbevent.Writer
}

// openMetrics opens metrics.jsonl for appending, first dropping lines of
// steps after step (written by a run that died after its last checkpoint:
// the resumed run writes them again).
func openMetrics(cfg *Config, step int) (*metrics, error) {
	path := filepath.Join(cfg.RunDir, "metrics.jsonl")
	if b, err := os.ReadFile(path); err == nil {
		var keep bytes.Buffer
		for _, line := range bytes.SplitAfter(b, []byte("\n")) {
			var l struct {
				Step int `json:"step"`
			}
			if len(bytes.TrimSpace(line)) == 0 || !bytes.HasSuffix(line, []byte("\n")) {
				continue // a torn last line
			}
			if json.Unmarshal(line, &l) == nil && l.Step <= step {
				keep.Write(line)
			}
		}
		if err := atomicfile.WriteFile(path, keep.Bytes(), 0o644); err != nil {
			return nil, err
		}
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, err
	}
	m := &metrics{f: f, w: bufio.NewWriter(f)}
	if cfg.Log.TensorBoard {
		if m.tb, err = tbevent.Create(filepath.Join(cfg.RunDir, "tb")); err != nil {
			f.Close()
			return nil, err
		}
		if step > 0 {
			// Resumed: TensorBoard drops what the earlier run logged past
			// its checkpoint, as metrics.jsonl was trimmed above.
			if err := m.tb.SessionStart(int64(step+1), time.Now()); err != nil {
				m.tb.Close()
				f.Close()
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) train(sm StepMetrics) error {
	b, err := marshalFinite(sm)
	if err != nil {
		return fmt.Errorf("trainer: metrics of step %d: %w", sm.Step, err)
	}
	if _, err := m.w.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("trainer: writing metrics.jsonl: %w", err)
	}
	if m.tb != nil {
		sc := map[string]float64{
			"train/loss": sm.Loss, "train/kd": sm.KD, "train/ce": sm.CE, "train/lr": sm.LR, "train/grad_norm": sm.GradNorm,
			"perf/tokens_per_s": sm.TokensPerSec, "perf/data_s": sm.DataSeconds, "perf/gflop_per_s": sm.GFLOPs, "perf/peak_mem_gib": float64(sm.PeakMemBytes) / (1 << 30),
		}
		teacherScalars(sc, "train", sm.Teachers)
		if sm.ExpertShare != nil {
			sc["moe/aux_loss"] = sm.AuxLoss
			for e, v := range sm.ExpertShare {
				sc[fmt.Sprintf("moe/expert_share/%d", e)] = v
			}
		}
		return m.tb.Scalars(int64(sm.Step), time.Now(), sc)
	}
	return nil
}

func (m *metrics) eval(step int, es EvalStats) error {
	b, err := marshalFinite(struct {
		Type string `json:"type"`
		Step int    `json:"step"`
		EvalStats
	}{"eval", step, es})
	if err != nil {
		return fmt.Errorf("trainer: eval metrics of step %d: %w", step, err)
	}
	if _, err := m.w.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("trainer: writing metrics.jsonl: %w", err)
	}
	if m.tb != nil {
		sc := map[string]float64{
			"eval/loss": es.Loss, "eval/kd": es.KD, "eval/ce": es.CE, "eval/token_accuracy": es.TokenAccuracy, "eval/top1_agreement": es.Top1Agreement,
		}
		teacherScalars(sc, "eval", es.Teachers)
		return m.tb.Scalars(int64(step), time.Now(), sc)
	}
	return nil
}

// marshalFinite encodes a struct of scalars (and lists of such structs)
// as encoding/json does (field order, json tags, omitempty, embedded
// structs flattened), except that a NaN or infinite float becomes null,
// which JSON can hold and json.Marshal refuses.
func marshalFinite(v any) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte('{')
	first := true
	var walk func(rv reflect.Value) error
	walk = func(rv reflect.Value) error {
		rt := rv.Type()
		for i := 0; i < rt.NumField(); i++ {
			f, fv := rt.Field(i), rv.Field(i)
			tag := f.Tag.Get("json")
			if f.Anonymous && f.Type.Kind() == reflect.Struct && tag == "" {
				if err := walk(fv); err != nil {
					return err
				}
				continue
			}
			name, opts, _ := strings.Cut(tag, ",")
			if !f.IsExported() || name == "-" {
				continue
			}
			if name == "" {
				name = f.Name
			}
			if strings.Contains(opts, "omitempty") && fv.IsZero() {
				continue
			}
			var b []byte
			if k := fv.Kind(); (k == reflect.Float64 || k == reflect.Float32) && (math.IsNaN(fv.Float()) || math.IsInf(fv.Float(), 0)) {
				b = []byte("null")
			} else if k == reflect.Slice && fv.Type().Elem().Kind() == reflect.Struct {
				// A list of structs of scalars (the per-teacher metrics):
				// each element as this function writes a struct.
				b = []byte{'['}
				for j := 0; j < fv.Len(); j++ {
					e, err := marshalFinite(fv.Index(j).Interface())
					if err != nil {
						return fmt.Errorf("%s[%d]: %w", name, j, err)
					}
					if j > 0 {
						b = append(b, ',')
					}
					b = append(b, e...)
				}
				b = append(b, ']')
			} else {
				var err error
				if b, err = json.Marshal(fv.Interface()); err != nil {
					return fmt.Errorf("%s: %w", name, err)
				}
			}
			if !first {
				buf.WriteByte(',')
			}
			first = false
			nb, _ := json.Marshal(name)
			buf.Write(nb)
			buf.WriteByte(':')
			buf.Write(b)
		}
		return nil
	}
	if err := walk(reflect.ValueOf(v)); err != nil {
		return nil, err
	}
	buf.WriteByte('}')
	return buf.Bytes(), nil
}

func (m *metrics) flush() error {
	if err := m.w.Flush(); err != nil {
		return err
	}
	if m.tb != nil {
		if err := m.tb.Flush(); err != nil {
			return err
		}
	}
	return m.f.Sync()
}

func (m *metrics) close() {
	m.flush()
	m.f.Close()
	if m.tb != nil {
		m.tb.Close()
	}
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
