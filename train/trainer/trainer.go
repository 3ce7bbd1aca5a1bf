// Package trainer runs student training from a teacher cache: it builds
// the student (from an HF checkpoint or a random architecture), packs the
// cache's samples into rows, accumulates gradients to a global batch in
// tokens, steps AdamW on a schedule, evaluates on a held-out sample range,
// writes metrics (JSONL and TensorBoard) and atomic checkpoints, and
// resumes from them bit for bit.
//
// # Run directory
//
//	RUN_DIR/
//	  config.yaml                   the resolved config (defaults, overrides, tokenizer fingerprint)
//	  metrics.jsonl                 one JSON object per step ("type":"train") and per eval ("type":"eval")
//	  tb/events.out.tfevents.*      the same scalars for TensorBoard (package tbevent)
//	  checkpoints/step-NNNNNNNN/    the newest checkpoint.keep checkpoints:
//	    config.json                 HF config of the student
//	    model.safetensors           F32 master weights (an HF checkpoint: export and infer read it)
//	    optimizer.safetensors       AdamW moments: exp_avg.<tensor>, exp_avg_sq.<tensor>
//	    state.json                  step, data position, schedule, NVFP4 amax, loss definition (State)
//	  checkpoints/.tmp-step-*       a checkpoint being written (never read; removed on save)
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
	"runtime"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"distill/cache"
	"distill/compute/cpu"
	"distill/data/tokenizer"
	"distill/model"
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
}

// StepMetrics are one optimizer step's metrics (a metrics.jsonl line).
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
	GFLOPs       float64 `json:"gflop_per_s"` // achieved, model FLOPs (see stepFLOPs)
	PeakMemBytes int64   `json:"peak_mem_bytes"`
	Skipped      bool    `json:"skipped,omitempty"` // non-finite gradient: no update
	Epoch        int     `json:"epoch"`
	WallTime     float64 `json:"wall_time"`
}

// Result summarizes a Run.
type Result struct {
	Steps      []StepMetrics // the steps run by this call
	Evals      []EvalStats
	Checkpoint string // the newest checkpoint written
	Resumed    string // the checkpoint resumed from, if any
}

// Run trains as cfg says and returns the metrics of the steps it ran.
func Run(cfg *Config, o Options) (*Result, error) {
	if o.Log == nil {
		o.Log = os.Stderr
	}
	if o.Resume == "" {
		o.Resume = "auto"
	}
	if cfg.Train.Threads > 0 {
		cpu.Threads = cfg.Train.Threads
	}
	rd, err := cache.OpenReader(cfg.Data.Cache...)
	if err != nil {
		return nil, err
	}
	m := rd.Manifest()
	if err := os.MkdirAll(cfg.RunDir, 0o755); err != nil {
		return nil, err
	}
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
	st := &State{DataSeed: cfg.Seed, LRSchedule: cfg.Optim.Schedule, LR: cfg.Optim.LR, MaxSteps: cfg.Train.MaxSteps,
		CacheTeacher: m.TeacherFingerprint, CacheDataset: m.DatasetFingerprint}
	st.setBatching(cfg)
	st.setLoss(cfg)
	if ckpt != "" {
		s, st, err = loadCheckpoint(ckpt)
		if err != nil {
			return nil, err
		}
		res.Resumed = ckpt
		if st.DataSeed != cfg.Seed {
			return nil, fmt.Errorf("%w: %s was trained with seed %d, the config says %d", ErrResume, ckpt, st.DataSeed, cfg.Seed)
		}
		if (st.QuantAmax != nil) != (cfg.Quant == "nvfp4") {
			return nil, fmt.Errorf("%w: %s has NVFP4 state %v but the config says quant: %s", ErrResume, ckpt, st.QuantAmax != nil, cfg.Quant)
		}
		if st.CacheTeacher != m.TeacherFingerprint || st.CacheDataset != m.DatasetFingerprint {
			return nil, fmt.Errorf("%w: %s was trained on the cache of teacher %.12s / dataset %.12s, data.cache is teacher %.12s / dataset %.12s: resume on the same cache or start a new run_dir",
				ErrResume, ckpt, st.CacheTeacher, st.CacheDataset, m.TeacherFingerprint, m.DatasetFingerprint)
		}
		if err := st.checkBatching(cfg, ckpt); err != nil {
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
	} else if s, err = initStudent(cfg); err != nil {
		return nil, err
	}
	fp, err := tokenizerFingerprint(cfg)
	if err != nil {
		return nil, err
	}
	cfg.Model.TokenizerFingerprint, st.TokenizerFingerprint = fp, fp
	if err := CheckCache(s.Cfg, fp, &m, strings.Join(cfg.Data.Cache, ",")); err != nil {
		return nil, err
	}
	if cfg.Data.SeqLen > s.Cfg.MaxPositions {
		return nil, fmt.Errorf("%w: data.seq_len %d exceeds the student's max_position_embeddings %d", ErrConfig, cfg.Data.SeqLen, s.Cfg.MaxPositions)
	}
	lopt := cfg.LossOptions(float64(m.Temperature))
	if err := lopt.Validate(); err != nil {
		return nil, fmt.Errorf("%w: distill (cache captured at temperature %g): %w", ErrConfig, m.Temperature, err)
	}
	held := cache.Range{Start: -1, End: -1}
	if len(cfg.Data.EvalRange) == 2 {
		held = cache.Range{Start: cfg.Data.EvalRange[0], End: cfg.Data.EvalRange[1]}
		if held.End > m.Samples {
			return nil, fmt.Errorf("%w: data.eval_range %v is past the cache's %d samples", ErrConfig, cfg.Data.EvalRange, m.Samples)
		}
	}
	ad, err := optim.NewAdamW(cfg.AdamW(), s.Groups())
	if err != nil {
		return nil, err
	}
	if ckpt != "" {
		if err := loadMoments(ckpt, ad, st.OptSteps); err != nil {
			return nil, err
		}
	}
	pk := &packer{seqLen: cfg.Data.SeqLen, truncate: cfg.Data.Truncate, k: m.K}
	if ckpt == "" && cfg.Quant == "nvfp4" {
		if err := calibrate(s, cfg, rd, held, pk, &lopt, o.Log); err != nil {
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
	stream, err := newStream(rd, cfg.Seed, cfg.Data.ShuffleWindow, held, st.Epoch, st.EpochPos)
	if err != nil {
		return nil, err
	}
	defer stream.close()
	if ckpt != "" {
		fmt.Fprintf(o.Log, "resumed from %s at step %d (epoch %d, sample %d of its order)\n", ckpt, st.Step, st.Epoch, st.EpochPos)
	}
	prog := newProgress(o.Log, cfg.Log.Progress, cfg.Log.Every, cfg.Train.MaxSteps)
	sched := cfg.Schedule()
	doEval := func(step int) error {
		if held.Start < 0 {
			return nil
		}
		r := held
		if cfg.Eval.MaxSamples > 0 {
			r.End = min(r.End, r.Start+int64(cfg.Eval.MaxSamples))
		}
		es, err := Evaluate(s, rd, r, cfg.Data.SeqLen, cfg.Data.Truncate, &lopt)
		if err != nil {
			return err
		}
		res.Evals = append(res.Evals, es)
		prog.clear()
		fmt.Fprintf(o.Log, "eval step %d: loss %.4f kd %.4f ce %.4f token_acc %.4f top1_agree %.4f (%d tokens)\n", step, es.Loss, es.KD, es.CE, es.TokenAccuracy, es.Top1Agreement, es.Tokens)
		return mw.eval(step, es)
	}
	ran := 0
	for step := st.Step + 1; step <= cfg.Train.MaxSteps; step++ {
		t0 := time.Now()
		rows, err := pk.nextStep(stream, cfg.Data.GlobalBatchTokens)
		if err != nil {
			return res, fmt.Errorf("step %d: %w", step, err)
		}
		total, tokens := 0, 0
		for _, b := range rows {
			total += counted(b)
			tokens += len(b.Tokens)
		}
		s.ZeroGrad()
		var sm StepMetrics
		for _, b := range rows {
			bs, err := s.ForwardBackward(b, &lopt, float64(total))
			if err != nil {
				return res, fmt.Errorf("step %d: %w", step, err)
			}
			w := float64(bs.Tokens)
			sm.Loss += bs.Loss * w
			sm.KD += bs.KD * w
			sm.CE += bs.CE * w
		}
		if total > 0 {
			sm.Loss, sm.KD, sm.CE = sm.Loss/float64(total), sm.KD/float64(total), sm.CE/float64(total)
		}
		sm.GradNorm = optim.ClipGradNorm(ad.Groups, cfg.Optim.MaxGradNorm)
		sm.LR = sched.LR(step)
		if math.IsNaN(sm.GradNorm) || math.IsInf(sm.GradNorm, 0) {
			// One bad batch must not poison the weights: skip the update,
			// say so, and let the run go on (the moments are untouched).
			sm.Skipped = true
			prog.clear()
			fmt.Fprintf(o.Log, "step %d: gradient norm %g (loss %g, kd %g, ce %g): update skipped\n", step, sm.GradNorm, sm.Loss, sm.KD, sm.CE)
		} else {
			ad.Step(sm.LR)
		}
		st.Step, st.OptSteps, st.Tokens = step, ad.Steps, st.Tokens+int64(tokens)
		st.Epoch, st.EpochPos = stream.epoch, stream.pos
		dt := time.Since(t0).Seconds()
		sm.Type, sm.Step, sm.Tokens, sm.LossTokens, sm.Rows, sm.Epoch = "train", step, tokens, total, len(rows), stream.epoch
		sm.TokensPerSec = float64(tokens) / dt
		sm.GFLOPs = stepFLOPs(s.Cfg, rows, total) / dt / 1e9
		sm.PeakMemBytes = peakMem()
		sm.WallTime = float64(time.Now().UnixNano()) / 1e9
		res.Steps = append(res.Steps, sm)
		if err := mw.train(sm); err != nil {
			return res, err
		}
		prog.step(sm)
		ran++
		if o.StopAfter > 0 && ran == o.StopAfter {
			return res, nil
		}
		last := step == cfg.Train.MaxSteps
		if (cfg.Eval.Every > 0 && step%cfg.Eval.Every == 0) || last {
			if err := doEval(step); err != nil {
				return res, err
			}
		}
		if (cfg.Checkpoint.Every > 0 && step%cfg.Checkpoint.Every == 0) || last {
			// Metrics first: a checkpoint never refers to lines not on disk.
			if err := mw.flush(); err != nil {
				return res, err
			}
			p, err := saveCheckpoint(cfg.RunDir, s, ad, st, cfg.Checkpoint.Keep)
			if err != nil {
				return res, err
			}
			res.Checkpoint = p
		}
	}
	prog.clear()
	if len(res.Steps) == 0 {
		fmt.Fprintf(o.Log, "nothing to do: %s is at step %d of train.max_steps %d\n", cfg.RunDir, st.Step, cfg.Train.MaxSteps)
	} else {
		fmt.Fprintf(o.Log, "done: step %d, checkpoint %s\n", st.Step, res.Checkpoint)
	}
	return res, nil
}

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

// initStudent builds a fresh student as the config says.
func initStudent(cfg *Config) (*train.Student, error) {
	if cfg.Model.InitFrom != "" {
		return train.LoadHF(cfg.Model.InitFrom)
	}
	mc, err := cfg.Model.Random.ModelConfig()
	if err != nil {
		return nil, err
	}
	s, err := train.NewStudent(mc)
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
// the package doc).
func tokenizerFingerprint(cfg *Config) (string, error) {
	if fp := cfg.Model.TokenizerFingerprint; fp != "" {
		return fp, nil
	}
	dir := cfg.Model.Tokenizer
	if dir == "" && cfg.Model.InitFrom != "" {
		if _, err := os.Stat(filepath.Join(cfg.Model.InitFrom, "tokenizer.json")); err == nil {
			dir = cfg.Model.InitFrom
		}
	}
	if dir == "" {
		return "", fmt.Errorf("%w: model: the student's tokenizer is unknown; set model.tokenizer (a directory with tokenizer.json) or model.tokenizer_fingerprint (the cache's is printed by `cachectl status`)", ErrConfig)
	}
	tk, err := tokenizer.Load(dir)
	if err != nil {
		return "", fmt.Errorf("%w: model.tokenizer %s: %w", ErrConfig, dir, err)
	}
	return tk.Fingerprint(), nil
}

// calibrate switches NVFP4 QAD on and calibrates the amax on the first
// calib_batches packed rows of the training order (a separate pass over
// the order, so training then sees the same data with or without QAD).
func calibrate(s *train.Student, cfg *Config, rd *cache.Reader, held cache.Range, pk *packer, lopt *loss.Options, log io.Writer) error {
	if err := s.EnableQAD(); err != nil {
		return err
	}
	cs, err := newStream(rd, cfg.Seed, cfg.Data.ShuffleWindow, held, 0, 0)
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
	perLayer := C*(q+2*kv) + q*C + 3*C*float64(c.Intermediate)
	var f, att float64
	for _, b := range rows {
		f += 6 * perLayer * float64(c.Layers) * float64(len(b.Tokens))
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
		if err := writeFileSync(path+".tmp", keep.Bytes()); err != nil {
			return nil, err
		}
		if err := os.Rename(path+".tmp", path); err != nil {
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
	b, _ := json.Marshal(sm)
	m.w.Write(append(b, '\n'))
	if m.tb != nil {
		return m.tb.Scalars(int64(sm.Step), time.Now(), map[string]float64{
			"train/loss": sm.Loss, "train/kd": sm.KD, "train/ce": sm.CE, "train/lr": sm.LR, "train/grad_norm": sm.GradNorm,
			"perf/tokens_per_s": sm.TokensPerSec, "perf/gflop_per_s": sm.GFLOPs, "perf/peak_mem_gib": float64(sm.PeakMemBytes) / (1 << 30),
		})
	}
	return nil
}

func (m *metrics) eval(step int, es EvalStats) error {
	b, _ := json.Marshal(struct {
		Type string `json:"type"`
		Step int    `json:"step"`
		EvalStats
	}{"eval", step, es})
	m.w.Write(append(b, '\n'))
	if m.tb != nil {
		return m.tb.Scalars(int64(step), time.Now(), map[string]float64{
			"eval/loss": es.Loss, "eval/kd": es.KD, "eval/ce": es.CE, "eval/token_accuracy": es.TokenAccuracy, "eval/top1_agreement": es.Top1Agreement,
		})
	}
	return nil
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
