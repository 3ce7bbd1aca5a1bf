package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"distill/cache"
	dev "distill/compute/device"
	"distill/data"
	"distill/data/tokenizer"
	"distill/internal/cli"
	"distill/internal/stall"
	"distill/serve"
)

func init() {
	commands.Register(&cli.Command{Name: "fill", Summary: "fill the cache over a sample range, through teacherd daemons or an in-process teacher",
		Run: func(args []string) error {
			ctx, stop := signalContext()
			defer stop()
			return interrupted(ctx, fillMain(ctx, args, os.Stdout, os.Stderr))
		}})
}

// signalError is the cause of a context a signal cancelled.
type signalError struct{ sig os.Signal }

func (e signalError) Error() string { return cli.SignalName(e.sig) }

// signalContext is cancelled, with a signalError as its cause, by the
// first SIGINT or SIGTERM; a second one ends the process at once.
func signalContext() (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.Background())
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	done := make(chan struct{})
	go func() {
		select {
		case sig := <-sigs:
			signal.Stop(sigs) // the next one kills
			cancel(signalError{sig})
		case <-done:
		}
	}()
	return ctx, func() {
		signal.Stop(sigs)
		close(done)
		cancel(nil)
	}
}

// interrupted turns the error of a job a signal stopped into a
// cli.Interrupted (exit 128+signal; the error says how to resume).
func interrupted(ctx context.Context, err error) error {
	var se signalError
	if err == nil || !errors.As(context.Cause(ctx), &se) {
		return err
	}
	ss, _ := se.sig.(syscall.Signal)
	return &cli.Interrupted{Signal: ss, Msg: err.Error()}
}

func fillMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("cachectl fill", flag.ContinueOnError)
	fs.SetOutput(stderr)
	teachers := fs.String("teacher", "", "teacherd addresses ADDR[,ADDR...]; each writes the cache directory it was started with")
	modelDir := fs.String("model", "", "run the teacher in this process from this HF checkpoint (instead of --teacher)")
	cacheDir := fs.String("cache", "", "with --model: the cache directory to write")
	tokDir := fs.String("tokenizer", "", "tokenizer directory: with --model, the tokenizer to use (default: the model's); with --teacher, checked against the daemons'")
	device := fs.String("device", "auto", "with --model: auto (a GPU when one opens, else the CPU), cpu or cuda")
	// Not --weights: that is the dataset flags' blend weights (dataflags.go).
	tweights := fs.String("teacher-weights", "", "with --model: the teacher's layers' Linear weights, bf16 (default) or fp8 (E4M3 per output channel, quantized at load; a different teacher fingerprint); teacherd's --weights")
	devices := fs.String("devices", "", "with --model: split the teacher's layers over these GPUs, a pipeline stage each: ordinals 0,1,2,3 (one may repeat) or all (teacherd --devices)")
	micro := fs.Int("micro-batches", 0, "with --model --devices: micro-batches a forward is cut into (default: four a GPU, none under 1024 tokens)")
	budget := fs.Int("token-budget", 0, "with --model: tokens per forward pass (default 8192); on a GPU, checked at start against its free memory")
	pretok := fs.Bool("pretokenized", false, "records hold input_ids (and loss_mask), no text (a record with text and no input_ids is a bad record; text beside the ids is not read): no tokenizer, ids checked against the vocab")
	var df datasetFlags
	df.register(fs, "as the teachers see them (with --model: as this machine does)")
	start := fs.Int64("start", 0, "first sample")
	end := fs.Int64("end", 0, "one past the last sample (0: the dataset's length)")
	chunk := fs.Int64("chunk", serve.DefaultChunkSamples, "samples per chunk (the unit of work and of crash recovery)")
	k := fs.Int("k", 0, "top-k entries per position (0: the teacher's default); the head of --targets head+sampled")
	targets := fs.String("targets", "topk", "what each position stores: topk (the top-k), sampled (--samples draws from the teacher's full distribution, as ids and counts) or head+sampled (the top --k plus --samples draws from outside it, with the tail mass); see the cache package doc")
	samples := fs.Int("samples", 0, "draws per position of --targets sampled and head+sampled (1 to 4096)")
	temp := fs.Float64("temperature", 0, "capture temperature (0: 1)")
	encoding := fs.String("encoding", "", "log-prob encoding: compact (default) or lossless")
	var auth authFlags
	auth.register(fs)
	perTeacher := fs.Int("per-teacher", 2, "chunks in flight per teacher")
	retryFor := fs.Duration("retry-for", 2*time.Minute, "how long a teacher that does not answer (unreachable, or still loading its model) is waited for: at the start, until one answers; during the fill, before its work goes to the others only (0: not at all)")
	stallTimeout := fs.Duration("stall-timeout", stall.DefaultTimeout, "a teacher that sends nothing for a chunk this long, neither the chunk nor progress (a daemon sends progress after every forward pass), is taken as hung, though it answers pings: its chunk goes to the other teachers, or the fill fails when there is none; against an older teacherd, which sends no progress, it bounds each chunk (0: no limit)")
	logEvery := fs.Duration("log-every", 10*time.Second, "progress line interval when stderr is not a terminal")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %q (flags come as --name value)", fs.Args())
	}
	if (*teachers == "") == (*modelDir == "") {
		return cli.Usagef("give exactly one of --teacher ADDR[,ADDR...] (daemons) and --model DIR (in-process)")
	}
	if err := serve.CheckTargets(*targets, *samples, *k); err != nil {
		return cli.Usage(err) // the flags alone are wrong
	}
	// What needs no teacher is checked before one loads (a large one
	// takes minutes): the range, the chunk size, and with --model the
	// dataset's files, which are this machine's.
	if *retryFor < 0 {
		return cli.Usagef("--retry-for %s: want a duration >= 0 (0: fail at once when no teacher answers)", *retryFor)
	}
	if *stallTimeout < 0 {
		return cli.Usagef("--stall-timeout %s: want a duration >= 0 (0: no limit)", *stallTimeout)
	}
	if *start < 0 || (*end != 0 && *end <= *start) {
		return cli.Usagef("--start %d --end %d: want 0 <= --start < --end (--end 0: the dataset's length)", *start, *end)
	}
	if *chunk < 0 || *chunk > cache.MaxChunkSamples {
		return cli.Usagef("--chunk %d: want 1..%d (0: %d)", *chunk, cache.MaxChunkSamples, serve.DefaultChunkSamples)
	}
	srcs, opts, err := df.dataset()
	if err != nil {
		return err
	}
	if *teachers != "" {
		if err := checkDaemonPaths(srcs); err != nil {
			return err
		}
	}
	if *modelDir != "" {
		for _, s := range srcs {
			if _, err := os.Stat(s.Path); os.IsNotExist(err) {
				return fmt.Errorf("--data: %s does not exist", s.Path)
			} else if err != nil {
				return fmt.Errorf("--data: %w", err)
			}
		}
	}
	ds, err := serve.DatasetSpec(srcs, opts, *pretok)
	if err != nil {
		return err
	}
	if *retryFor == 0 {
		*retryFor = -1 // FillPlan's "not at all"; its 0 is the default
	}
	if *stallTimeout == 0 {
		*stallTimeout = -1 // FillPlan's "no watchdog"
	}
	plan := serve.FillPlan{Dataset: ds, Start: *start, End: *end, ChunkSamples: *chunk, K: int32(*k), Temperature: float32(*temp),
		Encoding: *encoding, Targets: *targets, Samples: int32(*samples), PerWorker: *perTeacher, RetryFor: *retryFor, StallTimeout: *stallTimeout, Out: stderr, Terminal: isTerminal(stderr), LogEvery: *logEvery}
	var workers []serve.Worker
	defer func() {
		for _, w := range workers {
			w.Close()
		}
	}()
	if *modelDir != "" {
		w, err := inProcessWorker(stderr, serve.CoreOptions{ModelDir: *modelDir, Weights: *tweights, TokenizerDir: *tokDir, CacheDir: *cacheDir,
			Device: *device, MicroBatches: *micro, TokenBudget: *budget, InProcess: true, KMax: *k, MaxDraws: *samples}, *devices)
		if err != nil {
			return err
		}
		workers = append(workers, w)
	} else {
		if *cacheDir != "" {
			return cli.Usagef("--cache is for --model; each daemon writes the cache directory it was started with (teacherd --cache)")
		}
		if *tweights != "" {
			return cli.Usagef("--teacher-weights is for --model; each daemon holds the weights it was started with (teacherd --weights)")
		}
		if *devices != "" {
			return cli.Usagef("--devices is for --model; a daemon spreads its teacher over the GPUs it was started with (teacherd --devices)")
		}
		if workers, err = dialTeachers(&plan, *teachers, *tokDir, auth); err != nil {
			return err
		}
	}
	_, err = serve.RunFill(ctx, workers, plan)
	if err != nil && !df.skipBad && errors.Is(err, data.ErrBadRecord) {
		// The chunks before the bad record are kept: say how to go past it.
		err = fmt.Errorf("%w\n(fix the record and run the same command to resume, or add --skip-bad to store bad records as empty samples, counted in the fill's log)", err)
	}
	return err
}

// inProcessWorker is the teacher of `cachectl fill --model`: o's flags
// checked (--cache, --device against --devices, --micro-batches) before
// it loads in this process, on the GPUs devices names (o.Devices).
func inProcessWorker(stderr io.Writer, o serve.CoreOptions, devices string) (serve.Worker, error) {
	if o.CacheDir == "" {
		return nil, cli.Usagef("--model needs --cache DIR (the cache directory to write)")
	}
	if err := dev.CheckStagesOf(o.Device, devices); err != nil {
		return nil, cli.Usage(err) // --device cpu --devices all, before all's GPUs are counted
	}
	ords, err := dev.ParseDevices(devices)
	if err != nil {
		return nil, cli.Usage(err) // --devices' syntax
	}
	if len(ords) > 0 {
		if err := dev.CheckStages(o.Device, ords); err != nil {
			return nil, cli.Usage(err) // --device cpu --devices 0,1, before the teacher loads
		}
	}
	if o.MicroBatches < 0 {
		return nil, cli.Usagef("--micro-batches %d: want 0 (four a GPU) or more", o.MicroBatches)
	}
	o.Devices = ords
	o.DeviceLogf = func(format string, args ...any) { fmt.Fprintf(stderr, "fill: "+format+"\n", args...) }
	fmt.Fprintf(stderr, "fill: loading teacher %s in-process\n", o.ModelDir)
	core, err := serve.NewCore(o)
	if err != nil {
		return nil, err
	}
	return serve.Local(core), nil
}

// dialTeachers dials each daemon of --teacher (the ones dialed so far
// returned with an error, for the caller to close), with --tokenizer's
// fingerprint set in plan to check theirs against.
func dialTeachers(plan *serve.FillPlan, teachers, tokDir string, auth authFlags) ([]serve.Worker, error) {
	if tokDir != "" {
		tok, err := tokenizer.Load(tokDir)
		if err != nil {
			return nil, fmt.Errorf("--tokenizer: %w", err)
		}
		plan.TokenizerFingerprint = tok.Fingerprint()
	}
	dialOpts, err := auth.options()
	if err != nil {
		return nil, err
	}
	var workers []serve.Worker
	for _, addr := range strings.Split(teachers, ",") {
		w, err := serve.Dial(strings.TrimSpace(addr), dialOpts)
		if err != nil {
			return workers, err
		}
		workers = append(workers, w)
	}
	return workers, nil
}

// checkDaemonPaths refuses a relative --data path of a fill through
// daemons, before any is dialed: a daemon opens the path on its own
// machine, from its own working directory, and takes only an absolute
// path under its --data-root. The path is not resolved here: the daemon
// may be another machine (a loopback address too, through an SSH
// tunnel), where this machine's absolute path names another file or
// none; the error gives it for the user to check and copy.
func checkDaemonPaths(srcs []data.Source) error {
	for _, s := range srcs {
		if filepath.IsAbs(s.Path) {
			continue
		}
		abs, err := filepath.Abs(s.Path)
		if err != nil {
			return cli.Usagef("--data %s is a relative path: a daemon (--teacher) opens --data on its own machine, and takes only an absolute path under its --data-root: give the absolute path as the daemon sees it", s.Path)
		}
		return cli.Usagef("--data %s is a relative path: a daemon (--teacher) opens --data on its own machine, and takes only an absolute path under its --data-root: give the absolute path as the daemon sees it, e.g. --data %s (this machine's path; a daemon on another machine may see the file elsewhere)", s.Path, abs)
	}
	return nil
}

// isTerminal reports whether w is a character device (a progress bar is
// drawn there; elsewhere, periodic log lines).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
