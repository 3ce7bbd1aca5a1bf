package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"distill/internal/cli"
	"distill/train/dist"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "train", Summary: "train a student on a teacher cache (KD + SFT), or fine-tune it on a dataset (SFT); optional NVFP4 QAD", Run: runTrain})
}

// multiFlag collects a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, " ") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func runTrain(args []string) error {
	fs := flag.NewFlagSet("student train", flag.ContinueOnError)
	config := fs.String("config", "", "YAML config file (see examples/train.yaml for every key)")
	var sets multiFlag
	fs.Var(&sets, "set", "override a config key, key.path=value (repeatable), e.g. --set optim.lr=3e-4")
	runDir := fs.String("run-dir", "", "override run_dir")
	cacheDirs := fs.String("cache", "", "override data.cache (comma-separated directories)")
	datasetFiles := fs.String("dataset", "", "override data.dataset.files and drop their data.dataset.weights (comma-separated .jsonl, .csv or .parquet files): SFT on a dataset, no teacher")
	maxSteps := fs.Int("max-steps", 0, "override train.max_steps")
	threads := fs.Int("threads", 0, "override train.threads")
	dev := fs.String("device", "", "override train.device: auto (the GPU when one's CUDA backend opens, else the CPU), cpu or cuda (the GPU, or an error naming what is missing)")
	resume := fs.String("resume", "auto", "auto: continue from the run directory's newest checkpoint if any; never; must")
	nproc := fs.Int("nproc-per-node", 1, "start this many ranks on this node (as torchrun --nproc-per-node does), one per GPU, for data-parallel training (train.zero picks the ZeRO stage; train.device cuda, NCCL)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	// The command line is checked before ranks start: each would refuse
	// it alike, and the launcher would report their failure as its own
	// (exit 1) rather than a usage error (2).
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *resume != "auto" && *resume != "never" && *resume != "must" {
		return cli.Usagef("--resume %q: want auto, never or must", *resume)
	}
	if *nproc < 1 {
		return cli.Usagef("--nproc-per-node %d: want at least 1", *nproc)
	}
	if err := checkSets(sets); err != nil {
		return err
	}
	if *nproc != 1 {
		return launchLocalRanks(*nproc, args)
	}
	env, err := dist.Discover()
	if err != nil {
		return err
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	typed := typedOverrides(sets, fs, given)
	sets = flagSets(sets, given, *runDir, *cacheDirs, *datasetFiles, *maxSteps, *threads, *dev)
	if *config == "" && len(sets) == 0 {
		return cli.Usagef("--config FILE is required (examples/train.yaml documents every key; --set key=value overrides one)")
	}
	st := catchStops()
	defer st.release()
	cfg, err := trainer.LoadConfigAs(*config, sets, typed)
	if err != nil {
		return err
	}
	o := trainer.Options{Resume: *resume, Stop: st.stop}
	leave := func(error) error { return nil }
	if env.WorldSize > 1 {
		p, l, err := rankOf(env, cfg, st.stop)
		if err != nil {
			return err
		}
		leave, o.Parallel = l, p
	}
	res, err := trainer.Run(cfg, o)
	if lerr := leave(err); err == nil {
		err = lerr
	}
	return stopped(cfg, env, o.Parallel != nil, res, err, st.signal())
}

// checkSets refuses a --set that is not key.path=value: a malformed
// flag value, a usage error (exit 2) found before ranks start or the
// config is read; it exited 1 as a bad config. A value the config then
// refuses (--set optim.lr=fast) is a bad config value (1).
func checkSets(sets []string) error {
	for _, s := range sets {
		if key, _, ok := strings.Cut(s, "="); !ok || key == "" {
			return cli.Usagef("--set %q: want key.path=value, e.g. --set optim.lr=3e-4", s)
		}
	}
	return nil
}

// flagSets appends to sets the config overrides of the dedicated flags
// given: they are sugar for --set and apply after it; a value given is
// passed on whatever it is, so that the config's validation refuses
// --max-steps -5 instead of ignoring it. Paths and the device go in as
// quoted strings: --set parses its value as YAML, and a path is not
// YAML ("--run-dir 'out/run #2'" trained into out/run, the rest read as
// a comment; "a: b" was a mapping; "null" no run_dir at all).
func flagSets(sets []string, given map[string]bool, runDir, cacheDirs, datasetFiles string, maxSteps, threads int, dev string) []string {
	if given["run-dir"] {
		sets = append(sets, "run_dir="+yamlString(runDir))
	}
	if given["cache"] {
		sets = append(sets, "data.cache="+yamlList(cacheDirs))
	}
	if given["dataset"] {
		// The files replace the config's, and with them their blend
		// weights (which counted the config's files), unless --set gives
		// weights for them.
		weighted := false
		for _, s := range sets {
			weighted = weighted || strings.HasPrefix(s, "data.dataset.weights=")
		}
		sets = append(sets, "data.dataset.files="+yamlList(datasetFiles))
		if !weighted {
			sets = append(sets, "data.dataset.weights=null")
		}
	}
	if given["max-steps"] {
		sets = append(sets, fmt.Sprintf("train.max_steps=%d", maxSteps))
	}
	if given["threads"] {
		sets = append(sets, fmt.Sprintf("train.threads=%d", threads))
	}
	if given["device"] {
		sets = append(sets, "train.device="+yamlString(dev))
	}
	return sets
}

// typedOverrides is the config overrides as the command line gave them,
// for the config's errors: the --set flags, then the flags that stand
// for config keys (flagSets' order), a value with spaces quoted.
func typedOverrides(sets []string, fs *flag.FlagSet, given map[string]bool) string {
	var typed []string
	for _, s := range sets {
		typed = append(typed, "--set "+s)
	}
	for _, name := range []string{"run-dir", "cache", "dataset", "max-steps", "threads", "device"} {
		if given[name] {
			v := fs.Lookup(name).Value.String()
			if v == "" || strings.ContainsAny(v, " \t\"'") {
				v = strconv.Quote(v)
			}
			typed = append(typed, "--"+name+" "+v)
		}
	}
	return strings.Join(typed, " ")
}

// yamlString is s as a YAML string scalar, whatever it holds (JSON's
// quoting is YAML's double-quoted style).
func yamlString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// yamlList is a comma-separated flag value as a YAML list of strings,
// each trimmed of spaces (as the list's flow form trimmed them); "" is
// the empty list.
func yamlList(s string) string {
	if strings.TrimSpace(s) == "" {
		return "[]"
	}
	items := strings.Split(s, ",")
	for i, e := range items {
		items[i] = yamlString(strings.TrimSpace(e))
	}
	return "[" + strings.Join(items, ", ") + "]"
}

// stops is student train's handling of SIGTERM (preemption) and Ctrl-C:
// the first closes stop, and the run finishes or abandons its step,
// writes a checkpoint and says how to resume (stopped); a second exits
// at once, 128+signal, without one. It is in place before anything slow
// happens.
type stops struct {
	stop, done chan struct{}
	sigs       chan os.Signal
	mu         sync.Mutex
	caught     os.Signal
}

func catchStops() *stops {
	st := &stops{stop: make(chan struct{}), done: make(chan struct{}), sigs: make(chan os.Signal, 2)}
	signal.Notify(st.sigs, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		select {
		case sig := <-st.sigs:
			st.mu.Lock()
			st.caught = sig
			st.mu.Unlock()
			fmt.Fprintf(os.Stderr, "student train: %s: stopping at the end of this step and writing a checkpoint (send it again to exit at once, without one)\n", sigName(sig))
			close(st.stop)
		case <-st.done:
			return
		}
		select {
		case sig := <-st.sigs:
			fmt.Fprintf(os.Stderr, "student train: second %s: exiting now, without a checkpoint\n", sigName(sig))
			os.Exit(128 + int(sig.(syscall.Signal)))
		case <-st.done:
		}
	}()
	return st
}

// signal is the signal caught, or nil.
func (st *stops) signal() os.Signal {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.caught
}

func (st *stops) release() {
	signal.Stop(st.sigs)
	close(st.done)
}

// stopped is the run's error, and for a run a stop ended its
// cli.Interrupted: exit 130 after Ctrl-C, and after SIGTERM
// train.sigterm_exit_status (0 by default: the scheduler that preempted
// the job requeues it). A rank that another rank's stop ended caught no
// signal itself (sig nil): it exits as the SIGTERM a scheduler sends one
// rank would have it exit. Rank 0 of a data-parallel job prints how to go
// on, the job's command; the other ranks say they stopped with it.
func stopped(cfg *trainer.Config, env dist.Env, parallel bool, res *trainer.Result, err error, sig os.Signal) error {
	ss, by := syscall.SIGTERM, "a stop on another rank"
	if s, ok := sig.(syscall.Signal); ok {
		ss, by = s, sigName(s)
	}
	exit0 := ss == syscall.SIGTERM && cfg.Train.SigtermExitStatus == 0
	if sig != nil && err != nil && parallel && res == nil {
		return &cli.Interrupted{Signal: ss, Exit0: exit0, Msg: fmt.Sprintf("stopped by %s before the first step (%v): nothing saved", by, err)}
	}
	if err != nil || !res.Interrupted {
		return err
	}
	if env.WorldSize > 1 && env.Rank != 0 {
		if res.Checkpoint == "" {
			return &cli.Interrupted{Signal: ss, Exit0: exit0, Msg: fmt.Sprintf("stopped by %s before the first step with the other ranks: nothing saved; rank 0 says how to start again", by)}
		}
		return &cli.Interrupted{Signal: ss, Exit0: exit0, Msg: fmt.Sprintf("stopped by %s after step %d of %d with the other ranks; rank 0 says how to resume", by, res.Step, cfg.Train.MaxSteps)}
	}
	if res.Checkpoint == "" {
		return &cli.Interrupted{Signal: ss, Exit0: exit0, Msg: fmt.Sprintf("stopped by %s before the first step: nothing saved\nstart again with: %s", by, resumeCommand(jobArgv(), ""))}
	}
	return &cli.Interrupted{Signal: ss, Exit0: exit0, Msg: fmt.Sprintf("stopped by %s after step %d of %d; checkpoint %s\nresume with: %s",
		by, res.Step, cfg.Train.MaxSteps, res.Checkpoint, resumeCommand(jobArgv(), "must"))}
}

func sigName(sig os.Signal) string {
	switch sig {
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGINT:
		return "SIGINT"
	}
	return fmt.Sprint(sig)
}

// resumeCommand is this command line, each word quoted for a POSIX shell
// where needed, with --resume set to resume when not "" (a last --resume
// wins: "must" continues from the checkpoint just written, and refuses to
// start over should it be gone). Relative paths in it are relative to
// the directory the run was started in.
func resumeCommand(argv []string, resume string) string {
	words := make([]string, 0, len(argv)+2)
	for _, a := range argv {
		words = append(words, shellQuote(a))
	}
	if resume != "" {
		words = append(words, "--resume", resume)
	}
	return strings.Join(words, " ")
}

func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./=:,@%+") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
