package trainer

import (
	"distill/compute"
	"distill/internal/errkind"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"distill/cache"
	"distill/compute/device"
	"distill/data"
	"distill/model"
	"distill/model/decoder"
	"distill/train"
	"distill/train/loss"
	"distill/train/optim"
)

// trainRun is one training run, as components with one job each:
//
//   - src, the Source: where the samples and their targets come from
//     (a cache, several caches, a dataset, live teachers), batches the
//     training order from a data position;
//   - ck, the checkpointer: resume, save, retention;
//   - step, the stepper: forward, loss, backward, clip, AdamW;
//   - eval, the evaluator: the held-out samples of the same source;
//   - out, the sinks: metrics.jsonl, TensorBoard, progress, log lines;
//   - stop, Options.Stop: SIGTERM and Ctrl-C end the run at a step
//     boundary with a checkpoint.
//
// setup wires them (each stage a method, in the order the checks must
// run) and loop drives them.
type trainRun struct {
	cfg *Config
	o   Options
	log io.Writer
	res *Result

	src  Source
	info SourceInfo
	// evalSrc and evalLopt, when set (eval.cache), are what the evals
	// read and score with, in place of src and lopt.
	evalSrc  Source
	evalLopt *loss.Options
	params   SourceParams
	batches  Batches // the training order
	ck       *checkpointer
	ckpt     string          // the checkpoint resumed from ("": a new run)
	be       compute.Backend // the device (train.device)
	s        *train.Student
	st       *State
	ad       *optim.AdamW
	lopt     loss.Options
	held     cache.Range // data.eval_range, never trained on (Start < 0: none)
	evalR    cache.Range // the part of it each eval reads
	step     *stepper
	eval     *evaluator
	out      *sinks
	stop     stopSignal
	skips    skipRun
	g        ranks  // the data-parallel group (single: one process)
	z1       *zero1 // ZeRO-1's sharding of AdamW over g; nil: none

	closers []func() // run's clean-up, undone last first
}

// stopSignal is Options.Stop: once closed, the run ends at the next step
// boundary (or between the rows of a step or an eval, abandoning it).
type stopSignal <-chan struct{}

func (c stopSignal) requested() bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// skipRun counts the consecutive steps whose update a non-finite
// gradient norm skipped.
type skipRun struct {
	n        int // consecutive skipped steps, up to the current one
	lastGood int // the last step whose update was applied
}

// runSteps is runOnce without the removal of what a run that never
// started left in its run directory: it sets the run up, then runs its
// loop, and undoes what setup did as it returns (or as an out-of-memory
// panic unwinds).
func runSteps(cfg *Config, o Options) (*Result, error) {
	r := newTrainRun(cfg, o)
	defer r.close()
	if done, err := r.setup(); err != nil || done {
		if err != nil {
			return nil, err
		}
		return r.res, nil
	}
	return r.loop()
}

// newTrainRun applies the defaults of Options.
func newTrainRun(cfg *Config, o Options) *trainRun {
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
	r := &trainRun{cfg: cfg, o: o, log: o.Log, res: &Result{}, stop: stopSignal(o.Stop), g: single,
		ck: &checkpointer{runDir: cfg.RunDir, keep: cfg.Checkpoint.Keep}}
	if p := o.Parallel; p != nil {
		r.g.rank, r.g.size, r.ck.ordinal = p.Rank, p.WorldSize, p.LocalRank
	}
	return r
}

// onClose registers clean-up for close, which runs it last first.
func (r *trainRun) onClose(f func()) { r.closers = append(r.closers, f) }

func (r *trainRun) close() {
	for i := len(r.closers) - 1; i >= 0; i-- {
		r.closers[i]()
	}
}

// setup runs every stage before step 1, in the order their checks must
// come: done is true for a run with nothing left to do.
func (r *trainRun) setup() (done bool, err error) {
	for _, stage := range []func() error{r.checkRunDir, r.openData, r.lockRunDir, r.openBackend, r.joinRanks, r.loadStudent, r.openSource, r.checkData, r.openEvalCache} {
		if err := stage(); err != nil {
			return false, err
		}
	}
	if r.st.Step >= r.cfg.Train.MaxSteps {
		// A no-op run leaves the run directory as it is: its config.yaml
		// still describes the run that made its checkpoints.
		fmt.Fprintf(r.log, "nothing to do: %s is at step %d of train.max_steps %d\n", r.cfg.RunDir, r.st.Step, r.cfg.Train.MaxSteps)
		return true, nil
	}
	for _, stage := range []func() error{r.buildOptimizer, r.calibrate, r.openSinks, r.openBatches} {
		if err := stage(); err != nil {
			return false, err
		}
	}
	r.wire()
	return false, nil
}

// openData opens the data: Options.Source, or the config's (a cache is
// opened now, so that a missing one fails before anything is written).
func (r *trainRun) openData() error {
	if r.o.Source != nil {
		r.src = r.o.Source
		return nil
	}
	src, err := newSource(r.cfg, r.log)
	r.src = src
	return err
}

// checkRunDir refuses, before anything is written, a run_dir that is a
// teacher cache or an HF model directory (model.ClassifyDir): the run's
// config.yaml, metrics.jsonl, tb/ and checkpoints/ went in among their
// files. A run directory (checkpoints/) is accepted: a run resumes in it.
func (r *trainRun) checkRunDir() error {
	dir := r.cfg.RunDir
	kind, what := model.ClassifyDir(dir)
	if kind != model.DirCache && kind != model.DirModel {
		return nil
	}
	alt := filepath.Clean(dir)
	if abs, err := filepath.Abs(alt); err == nil && (alt == "." || alt == ".." || alt == string(filepath.Separator)) {
		alt = abs
	}
	return errkind.Errorf(ErrConfig, "run_dir %s %s: a run writes its checkpoints/, config.yaml and metrics.jsonl into run_dir, which would mix them with that directory's files; nothing was written: give a new directory (run_dir, or student train --run-dir), e.g. %s-run",
		dir, what, alt)
}

// lockRunDir makes the run directory and takes its lock, then removes
// the checkpoints a crashed process was writing (never complete, never
// read). One trainer per run directory: a second one would resume from
// the first's live checkpoints and remove its checkpoint in progress.
func (r *trainRun) lockRunDir() error {
	if !r.g.leader() {
		return nil // rank 0 holds the run directory; the others only read its checkpoints
	}
	if err := os.MkdirAll(r.cfg.RunDir, 0o755); err != nil {
		return runDirError(r.cfg.RunDir, err)
	}
	lock, err := lockRunDir(r.cfg.RunDir)
	if err != nil {
		return err
	}
	r.onClose(lock.unlock)
	stale, _ := filepath.Glob(filepath.Join(r.cfg.RunDir, "checkpoints", ".tmp-*"))
	for _, d := range stale {
		os.RemoveAll(d)
	}
	return nil
}

// runDirError is the error of making run_dir dir, which said only
// "mkdir DIR: not a directory" (or "permission denied"), naming neither
// the setting nor the path at fault.
func runDirError(dir string, err error) error {
	const give = "give a directory this process can create and write (run_dir, or student train --run-dir)"
	if errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.EEXIST) {
		for p := filepath.Clean(dir); p != filepath.Dir(p); p = filepath.Dir(p) {
			if fi, e := os.Stat(p); e == nil && !fi.IsDir() {
				return fmt.Errorf("run_dir %s: %s is a file, not a directory: %s", dir, p, give)
			}
		}
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return fmt.Errorf("run_dir %s: cannot create %s (%v): %s", dir, pe.Path, pe.Err, give)
	}
	return fmt.Errorf("run_dir %s: %w", dir, err)
}

// openBackend opens the device the run trains on (train.device).
func (r *trainRun) openBackend() error {
	be, err := backend(r.cfg, r.log, r.ck.ordinal)
	if err != nil {
		return err
	}
	r.be = be
	if testHookBackend != nil {
		testHookBackend(be)
	}
	// A device's memory is not the garbage collector's: the run gives
	// back what it allocated, so that a process can run again.
	r.onClose(func() { device.Close(be) })
	return nil
}

// loadStudent loads the student and state of the checkpoint to resume
// from, or builds a fresh student: under ZeRO stages 2 and 3, this
// rank's part of it.
func (r *trainRun) loadStudent() error {
	ckpt, err := r.ck.latest(r.o.Resume)
	if err != nil {
		return err
	}
	r.ckpt = ckpt
	var sh *train.Sharding
	if r.g.size > 1 && r.cfg.Train.ZeRO >= 2 {
		sh = &train.Sharding{C: r.g.c, Stage: r.cfg.Train.ZeRO, Overlap: r.cfg.Train.Overlap(),
			FP32Gathers: r.cfg.Quant == "nvfp4"} // (QAD reads the blocks' fp32 weights)
	}
	if ckpt != "" {
		if r.s, r.st, err = r.ck.load(r.cfg, ckpt, r.be, sh, r.log); err != nil {
			return err
		}
		r.res.Resumed, r.res.Checkpoint, r.res.Step = ckpt, ckpt, r.st.Step
	} else {
		if r.s, err = initStudent(r.cfg, r.be, sh); err != nil {
			return err
		}
		r.st = newState(r.cfg)
		r.st.setLoRA(r.cfg, r.s)
	}
	r.onClose(r.s.Free)
	return nil
}

// joinRanks joins the data-parallel group (Options.Parallel) over the
// run's backend: the student, the step, the stop and the writes then
// follow the group (see Parallel).
func (r *trainRun) joinRanks() error {
	p := r.o.Parallel
	if p == nil {
		return nil
	}
	g, err := joinRanks(p, r.be)
	if err != nil {
		return err
	}
	r.g = g
	r.onClose(r.g.close)
	if r.g.leader() {
		holds := "each holding the whole student"
		switch r.cfg.Train.ZeRO {
		case 1:
			holds = "each holding the whole student and 1/N of AdamW's moments (ZeRO stage 1)"
		case 2:
			holds = "each holding the whole student's weights and 1/N of its gradients and moments (ZeRO stage 2)"
		case 3:
			holds = "each holding 1/N of the student's weights, gradients and moments, and two layers' whole weights at a time (ZeRO stage 3)"
		}
		fmt.Fprintf(r.log, "data parallel: %d ranks, %s; rank 0 writes %s\n", r.g.size, holds, r.cfg.RunDir)
		if r.cfg.online() {
			fmt.Fprintf(r.log, "data parallel with live teachers: every rank asks them for every sample of a step, %d times the teacher work of one process; fill a cache first (cachectl fill) and train from it\n", r.g.size)
		}
	}
	return nil
}

// openSource opens the source for the student, with the student's
// tokenizer, and records the data in the state (refusing a resume on
// other data or teachers).
func (r *trainRun) openSource() error {
	fp, tokDir, tok, err := tokenizerFingerprint(r.cfg)
	if err != nil {
		return err
	}
	if fp == "" {
		// A pre-tokenized dataset and no tokenizer: the student's is
		// that of the ids, as `cachectl fill --pretokenized` records it.
		fp = data.PretokenizedFingerprint(r.s.Cfg.VocabSize)
		fmt.Fprintf(r.log, "model.tokenizer_fingerprint: %s (data.dataset.pretokenized, and the config names no tokenizer)\n", fp)
	}
	r.params = SourceParams{Student: r.s.Cfg, TokenizerFingerprint: fp, Tokenizer: tok, TokenizerDir: tokDir, Log: r.log}
	r.onClose(r.src.Close)
	if r.info, err = r.src.Open(r.params); err != nil {
		return err
	}
	r.st.ChatTemplate = r.info.ChatTemplate
	return r.st.recordData(r.cfg, &r.info, &r.params, r.ckpt, r.log)
}

// checkData checks the data against the student (vocabulary, tokenizer,
// sample length), resolves the loss against the data's capture
// temperature, and checks the held-out range.
func (r *trainRun) checkData() error {
	cfg, m := r.cfg, &r.info.Manifest
	if err := r.src.Check(r.params); err != nil {
		return err
	}
	if cfg.Data.SeqLen > r.s.Cfg.MaxPositions {
		return errkind.Errorf(ErrConfig, "data.seq_len %d exceeds the student's max_position_embeddings %d", cfg.Data.SeqLen, r.s.Cfg.MaxPositions)
	}
	teacherT := float64(m.Temperature)
	if r.info.NoTeacher {
		teacherT = cfg.Distill.Temperature // no teacher: only CE counts
	}
	r.lopt = cfg.LossOptions(teacherT)
	if err := r.lopt.Validate(); err != nil {
		return errkind.Errorf(ErrConfig, "distill (cache captured at temperature %g): %w", m.Temperature, err)
	}
	r.held = cache.Range{Start: -1, End: -1}
	r.evalR = r.held
	if len(cfg.Data.EvalRange) != 2 {
		return nil
	}
	r.held = cache.Range{Start: cfg.Data.EvalRange[0], End: cfg.Data.EvalRange[1]}
	if r.held.End > m.Samples {
		kind := r.info.Kind
		if kind == "" {
			kind = "source"
		}
		return errkind.Errorf(ErrConfig, "data.eval_range %s is past the %s's %d samples", yamlInts(cfg.Data.EvalRange), kind, m.Samples)
	}
	r.evalR = r.held
	if cfg.Eval.MaxSamples > 0 {
		r.evalR.End = min(r.evalR.End, r.evalR.Start+int64(cfg.Eval.MaxSamples))
	}
	return r.src.CheckEval(r.evalR)
}

// openEvalCache opens eval.cache, a teacher's cache of the dataset's
// samples, for the evals: they then score the held-out samples against
// the teacher (top-1 agreement, KD at the cache's capture temperature),
// with the run's loss weights. The cache must suit this student
// (vocabulary, tokenizer), hold the held-out samples whole, and hold
// them as the dataset does: the same tokens and loss masks, compared
// sample by sample (not the fingerprints: a cache filled with another
// length limit or chunking holds the same samples when none was cut).
func (r *trainRun) openEvalCache() error {
	cfg := r.cfg
	if cfg.Eval.Cache == "" || r.evalR.Start < 0 {
		return nil
	}
	c := *cfg
	c.Data.Cache, c.Data.Caches, c.Data.Dataset = []string{cfg.Eval.Cache}, nil, nil
	src, err := openCacheSource(&c, r.log)
	if err != nil {
		return fmt.Errorf("eval.cache: %w", err)
	}
	r.onClose(src.Close)
	info, err := src.Open(r.params)
	if err != nil {
		return fmt.Errorf("eval.cache: %w", err)
	}
	if err := src.Check(r.params); err != nil {
		return fmt.Errorf("eval.cache: %w", err)
	}
	if err := src.CheckEval(r.evalR); err != nil {
		return fmt.Errorf("eval.cache: %w", err)
	}
	if err := sameSamples(src, r.src, r.evalR); err != nil {
		return errkind.Errorf(ErrConfig, "eval.cache %s: %w: fill it from the same dataset files with the same template and template variables", cfg.Eval.Cache, err)
	}
	lo := cfg.LossOptions(float64(info.Manifest.Temperature))
	if err := lo.Validate(); err != nil {
		return errkind.Errorf(ErrConfig, "eval.cache (captured at temperature %g): %w", info.Manifest.Temperature, err)
	}
	r.evalSrc, r.evalLopt = src, &lo
	fmt.Fprintf(r.log, "evals: samples %v of %s, scored against its teacher\n", r.evalR, cfg.Eval.Cache)
	return nil
}

// sameSamples checks that two sources pack samples r into the same rows:
// tokens, sample boundaries and loss masks.
func sameSamples(a, b Source, r cache.Range) error {
	ra, _, err := a.EvalRows(r)
	if err != nil {
		return err
	}
	rb, _, err := b.EvalRows(r)
	if err != nil {
		return err
	}
	if len(ra) != len(rb) {
		return fmt.Errorf("samples %v pack into %d rows from it, %d from data.dataset: they differ", r, len(ra), len(rb))
	}
	for i := range ra {
		x, y := ra[i], rb[i]
		if !slices.Equal(x.Tokens, y.Tokens) || !slices.Equal(x.Starts, y.Starts) || !slices.Equal(x.Mask, y.Mask) {
			return fmt.Errorf("row %d of samples %v differs from data.dataset's (tokens, sample boundaries or loss mask)", i, r)
		}
	}
	return nil
}

// buildOptimizer makes AdamW over the student's parameters (with the
// checkpoint's moments on resume), and picks the activation
// recomputation that fits the device.
func (r *trainRun) buildOptimizer() error {
	groups := r.s.Groups()
	var at func(int) (int, int)
	if r.s.ShardStage() > 0 {
		ps := r.s.ShardPieces(r.g.rank)
		at = func(i int) (int, int) { return ps[i].Off, r.s.Tensors[ps[i].Tensor].N }
	}
	if r.g.size > 1 && r.cfg.Train.ZeRO == 1 {
		r.z1 = newZero1(&r.g, r.s)
		groups, at = r.z1.groups(groups), r.z1.at
		if r.g.leader() {
			fmt.Fprintf(r.log, "ZeRO stage 1: AdamW's moments sharded over %d ranks (%d parameters a rank at most)\n", r.g.size, r.z1.bounds[1])
		}
	}
	ad, err := optim.NewAdamW(r.cfg.AdamW(), groups)
	if err != nil {
		return err
	}
	r.ad = ad
	r.onClose(ad.Free)
	if r.ckpt != "" {
		if err := loadMoments(r.ckpt, ad, r.st.OptSteps, at); err != nil {
			return resumeError(r.ckpt, err)
		}
	}
	rc, err := planRecompute(r.cfg, r.s, r.info.K, decoder.Recompute(r.st.Recompute), r.g.size, r.log)
	if err != nil {
		return err
	}
	if err := r.s.Model.SetRecompute(rc); err != nil {
		return err
	}
	r.st.Recompute = string(rc)
	return nil
}

// calibrate calibrates NVFP4 QAD's amax before a new QAD run's first
// step (a resumed one restored it from its checkpoint); a LoRA run's
// Linears' input amax (calibrateLoRA).
func (r *trainRun) calibrate() error {
	if r.s.LoRA() != nil {
		return r.calibrateLoRA()
	}
	if r.ckpt != "" || r.cfg.Quant != "nvfp4" {
		return nil
	}
	if err := calibrate(r.s, r.cfg.CalibBatches, r.src, r.held, r.cfg.Data.SeqLen, &r.lopt, r.log); err != nil {
		return err
	}
	r.st.QuantAmax = r.s.QuantAmax()
	return nil
}

// calibrateLoRA calibrates a LoRA run's Linears' input amax, which the
// merged model's NVFP4 export needs (its base is not calibrated: under
// quant: nvfp4 it is quantized as it loads), on calib_batches rows
// before the first step: a new run's, or a resumed one whose checkpoint
// has none (made before they were calibrated). Not when the sizes rule
// NVFP4 out, nor with calib_batches 0 (no NVFP4 export then).
func (r *trainRun) calibrateLoRA() error {
	if r.st.LoRA == nil || r.st.LoRA.InputAmax != nil || r.cfg.CalibBatches <= 0 {
		return nil
	}
	if err := decoder.NVFP4Sizes(r.s.Cfg); err != nil {
		fmt.Fprintf(r.log, "LoRA: no input calibration (%v): the merged model has no NVFP4 export\n", err)
		return nil
	}
	if err := calibrateInputs(r.s, r.cfg.CalibBatches, r.src, r.held, r.cfg.Data.SeqLen, &r.lopt, r.log); err != nil {
		return err
	}
	r.st.LoRA.InputAmax = r.s.InputAmax()
	return nil
}

// openSinks writes the resolved config.yaml and opens metrics.jsonl
// and the TensorBoard events.
func (r *trainRun) openSinks() error {
	if !r.g.leader() {
		r.out = &sinks{log: io.Discard} // rank 0 records the run
		return nil
	}
	if err := writeResolved(r.cfg); err != nil {
		return err
	}
	mw, err := openMetrics(r.cfg, r.st.Step)
	if err != nil {
		return err
	}
	r.onClose(mw.close)
	r.out = &sinks{mw: mw, log: r.log}
	return nil
}

// openBatches starts the training order at the state's data position.
func (r *trainRun) openBatches() error {
	b, err := r.src.Batches(r.held, r.st.Epoch, r.st.EpochPos)
	if err != nil {
		return err
	}
	r.batches = b
	r.onClose(b.Close)
	if sm, ok := r.src.(summarizer); ok {
		r.onClose(func() { fmt.Fprintln(r.log, sm.summary()) })
	}
	if r.ckpt != "" {
		fmt.Fprintf(r.log, "resumed from %s at step %d (epoch %d, sample %d of its order)\n", r.ckpt, r.st.Step, r.st.Epoch, r.st.EpochPos)
	}
	return nil
}

// wire builds the loop's components from what setup made.
func (r *trainRun) wire() {
	r.out.prog = newProgress(r.out.log, r.cfg.Log.Progress, r.cfg.Log.Every, r.cfg.Train.MaxSteps)
	r.out.prog.sft = r.info.NoTeacher
	// Ranks stop together at step boundaries only (loop): one rank
	// abandoning a step or an eval would leave the others waiting.
	inner := r.stop
	if r.g.size > 1 {
		inner = nil
	}
	r.step = &stepper{s: r.s, ad: r.ad, clip: r.s.Groups(), lopt: &r.lopt, sched: r.cfg.Schedule(), maxNorm: r.cfg.Optim.MaxGradNorm,
		teachers: r.info.Teachers, stop: inner, log: r.log, g: &r.g, z1: r.z1, overlap: r.cfg.Train.Overlap()}
	r.eval = &evaluator{s: r.s, src: r.src, r: r.evalR, lopt: &r.lopt, teachers: r.info.Teachers, stop: inner, g: &r.g}
	if r.evalSrc != nil {
		r.eval.src, r.eval.lopt = r.evalSrc, r.evalLopt
		r.out.evalTeacher = true
	}
	r.ck.start(r.st, r.ckpt != "")
	r.skips.lastGood = r.st.Step
}

// loop trains from the step after the state's to train.max_steps. Each
// step takes its rows from the source, runs forward, loss and backward,
// clips and updates, records its metrics, and evaluates and checkpoints
// when due. A failure after step 1 saves the last finished step first.
func (r *trainRun) loop() (*Result, error) {
	cfg, ran := r.cfg, 0
	for step := r.st.Step + 1; step <= cfg.Train.MaxSteps; step++ {
		if r.g.anyStop(r.stop.requested()) {
			return r.interrupt()
		}
		t0 := time.Now()
		rows, sm, err := r.nextRows(t0)
		if err != nil {
			if d := cfg.Data.Dataset; d != nil && !d.SkipBad && errors.Is(err, data.ErrBadRecord) {
				err = fmt.Errorf("%w\n(fix the record, or set data.dataset.skip_bad: true to train past bad records, counted in the log)", err)
			}
			return r.fail(fmt.Errorf("step %d: %w", step, err))
		}
		if err := r.step.forwardBackward(step, rows, &sm); errors.Is(err, errStopped) {
			return r.interrupt()
		} else if err != nil {
			return r.fail(fmt.Errorf("step %d: %w", step, err))
		}
		r.update(step, &sm)
		r.advance(step, rows, &sm, t0)
		if err := r.out.train(sm); err != nil {
			return r.fail(err)
		}
		if ran++; r.o.StopAfter > 0 && ran == r.o.StopAfter {
			return r.res, nil
		}
		if limit := cfg.Train.MaxSkippedSteps; limit > 0 && r.skips.n >= limit {
			return r.diverged(step, limit)
		}
		last := step == cfg.Train.MaxSteps
		if due(cfg.Eval.Every, step, last) {
			if err := r.evaluate(step); errors.Is(err, errStopped) {
				fmt.Fprintf(r.log, "eval of step %d abandoned\n", step)
				return r.interrupt()
			} else if err != nil {
				return r.fail(fmt.Errorf("eval at step %d: %w", step, err))
			}
		}
		if due(cfg.Checkpoint.Every, step, last) {
			if err := r.save(); err != nil {
				return r.res, err
			}
		}
	}
	r.out.clear()
	fmt.Fprintf(r.log, "done: step %d, checkpoint %s\n", r.st.Step, r.res.Checkpoint)
	return r.res, nil
}

// due reports whether a stage that runs every `every` steps (0: never)
// and after the last runs at step.
func due(every, step int, last bool) bool {
	return (every > 0 && step%every == 0) || last
}

// nextRows takes the step's packed rows from the source; the step's
// metrics start with the time it took (from t0) and, online, the wait
// for the teachers.
func (r *trainRun) nextRows(t0 time.Time) ([]*train.Batch, StepMetrics, error) {
	var sm StepMetrics
	rows, err := r.batches.Next(r.cfg.Data.GlobalBatchTokens)
	if err != nil {
		return nil, sm, err
	}
	sm.DataSeconds = time.Since(t0).Seconds()
	if tw, ok := r.batches.(teacherWaiter); ok {
		w, depth := tw.teacherWait()
		sm.TeacherWaitSeconds, sm.QueueDepth = w.Seconds(), depth
	}
	return rows, sm, nil
}

// update clips and steps AdamW, or skips the update for a non-finite
// gradient norm and says so; the run of skipped steps is counted.
func (r *trainRun) update(step int, sm *StepMetrics) {
	if r.step.update(step, sm) {
		r.skips.n, r.skips.lastGood = 0, step
		return
	}
	r.skips.n++
	r.out.skipped(step, *sm)
}

// advance moves the state past step (steps, tokens, data position) and
// completes the step's metrics, which the Result collects.
func (r *trainRun) advance(step int, rows []*train.Batch, sm *StepMetrics, t0 time.Time) {
	st := r.st
	st.Step, st.OptSteps, st.Tokens = step, r.ad.Steps, st.Tokens+int64(sm.Tokens)
	st.Epoch, st.EpochPos = r.batches.Position()
	dt := time.Since(t0).Seconds()
	sm.Type, sm.Step, sm.Epoch = "train", step, st.Epoch
	sm.TokensPerSec = float64(sm.Tokens) / dt
	sm.GFLOPs = stepFLOPs(r.s.Cfg, rows, sm.LossTokens) / dt / 1e9
	sm.PeakMemBytes = peakMem()
	sm.WallTime = float64(time.Now().UnixNano()) / 1e9
	r.res.Steps = append(r.res.Steps, *sm)
	r.res.Step = step
}

// evaluate runs the eval of step and records it.
func (r *trainRun) evaluate(step int) error {
	es, ok, err := r.eval.run()
	if err != nil || !ok {
		return err
	}
	r.res.Evals = append(r.res.Evals, es)
	return r.out.eval(step, es)
}

// save writes the checkpoint of the state's step. Metrics first: a
// checkpoint never refers to lines not on disk.
func (r *trainRun) save() error {
	if l := r.shardLayout(); l != nil {
		var flushed error
		if r.g.leader() {
			flushed = r.out.mw.flush()
		}
		p, err := r.ck.saveSharded(l, r.s, r.ad, r.st, r.skips.n > 0, flushed)
		if err != nil {
			return err
		}
		r.res.Checkpoint = p
		return nil
	}
	moments := momentsOf(r.ad.Moments)
	if r.z1 != nil || r.s.ShardStage() > 0 { // every rank sends rank 0 its moments
		m, v := gatherMoments(&r.g, r.s, r.ad, r.z1)
		moments = func(i int) ([]float32, []float32) { return m[i], v[i] }
	}
	if r.s.ShardStage() > 0 && !r.g.leader() {
		r.s.Weights() // rank 0's checkpoint gathers them from every rank
	}
	if !r.g.leader() {
		// Rank 0 saves the same state, there.
		r.ck.saved, r.res.Checkpoint = r.st.Step, checkpointDir(r.cfg.RunDir, r.st.Step)
		return nil
	}
	if err := r.out.mw.flush(); err != nil {
		return err
	}
	p, err := r.ck.save(r.s, moments, r.st, r.skips.n > 0)
	if err != nil {
		return err
	}
	r.res.Checkpoint = p
	return nil
}

// fail ends the run on err after a checkpoint of the last finished step,
// when there is one to write: the weights, moments and data position of
// the state are consistent at every point where fail is called (an
// abandoned step has changed none of them).
func (r *trainRun) fail(err error) (*Result, error) {
	r.out.clear()
	if r.z1 != nil {
		// The moments are spread over the ranks, and this rank alone
		// fails: the last checkpoint is what remains.
		return r.res, fmt.Errorf("%w\n(rank %d: the last checkpoint is step %d's)", err, r.g.rank, r.ck.saved)
	}
	if r.st.Step > r.ck.saved {
		if serr := r.save(); serr != nil {
			return r.res, fmt.Errorf("%w (and the checkpoint of step %d failed: %v)", err, r.st.Step, serr)
		}
		return r.res, fmt.Errorf("%w\n(step %d saved in %s: fix the cause, then rerun the same command to resume)", err, r.st.Step, r.res.Checkpoint)
	}
	return r.res, err
}

// interrupt ends the run for Options.Stop with a checkpoint of the last
// finished step; the caller says why it stopped and how to resume.
func (r *trainRun) interrupt() (*Result, error) {
	r.out.clear()
	r.res.Interrupted, r.res.Step = true, r.st.Step
	if r.st.Step > r.ck.saved {
		if err := r.save(); err != nil {
			return r.res, err
		}
	}
	return r.res, nil
}

// diverged ends a run whose last limit updates were all skipped, naming
// the last good checkpoint, which retention kept.
func (r *trainRun) diverged(step, limit int) (*Result, error) {
	r.out.clear()
	if err := r.out.mw.flush(); err != nil {
		return r.res, err
	}
	n := r.skips.n
	return r.res, fmt.Errorf("%w: steps %d to %d: %d consecutive updates skipped for a non-finite gradient norm (train.max_skipped_steps %d); the weights are those of step %d, and %s; lower optim.lr, set optim.max_grad_norm, or check the data of these steps",
		ErrDiverged, step-n+1, step, n, limit, r.skips.lastGood, r.ck.lastGood())
}
