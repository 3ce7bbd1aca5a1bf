package main

import (
	"flag"
	"fmt"
	"strings"

	"distill/internal/cli"
	"distill/train/trainer"
)

func init() {
	commands.Register(&cli.Command{Name: "train", Summary: "train a student on a teacher cache (KD + SFT, optional NVFP4 QAD)", Run: runTrain})
}

// multiFlag collects a repeatable string flag.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, " ") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

func runTrain(args []string) error {
	fs := flag.NewFlagSet("student train", flag.ContinueOnError)
	config := fs.String("config", "", "YAML config file (see train/testdata/tiny.yaml for every key)")
	var sets multiFlag
	fs.Var(&sets, "set", "override a config key, key.path=value (repeatable), e.g. --set optim.lr=3e-4")
	runDir := fs.String("run-dir", "", "override run_dir")
	cacheDirs := fs.String("cache", "", "override data.cache (comma-separated directories)")
	maxSteps := fs.Int("max-steps", 0, "override train.max_steps")
	threads := fs.Int("threads", 0, "override train.threads")
	resume := fs.String("resume", "auto", "auto: continue from the run directory's newest checkpoint if any; never; must")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if *resume != "auto" && *resume != "never" && *resume != "must" {
		return fmt.Errorf("--resume %q: want auto, never or must", *resume)
	}
	// Dedicated flags are sugar for --set and apply after it.
	if *runDir != "" {
		sets = append(sets, "run_dir="+*runDir)
	}
	if *cacheDirs != "" {
		sets = append(sets, "data.cache=["+*cacheDirs+"]")
	}
	if *maxSteps > 0 {
		sets = append(sets, fmt.Sprintf("train.max_steps=%d", *maxSteps))
	}
	if *threads > 0 {
		sets = append(sets, fmt.Sprintf("train.threads=%d", *threads))
	}
	cfg, err := trainer.LoadConfig(*config, sets)
	if err != nil {
		return err
	}
	_, err = trainer.Run(cfg, trainer.Options{Resume: *resume})
	return err
}
