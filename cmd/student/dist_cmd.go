package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"

	"distill/internal/cli"
	"distill/train/dist"
	"distill/train/trainer"
)

// launchLocalRanks runs `student train ARGS` (without --nproc-per-node) as
// n local ranks (dist.Launch).
func launchLocalRanks(n int, args []string) error {
	env, err := dist.Discover()
	if err != nil {
		return err
	}
	if env.WorldSize > 1 {
		return fmt.Errorf("--nproc-per-node %d inside a job that already has %d processes (%s): leave --nproc-per-node out under torchrun or srun", n, env.WorldSize, env.Launcher)
	}
	return dist.Launch(dist.LaunchOptions{NProc: n, Args: append([]string{"train"}, withoutFlag(args, "nproc-per-node")...)})
}

// trainRank joins the job env describes with the resolved config, then
// stops: data-parallel training is not built yet. It returns an error
// either way. A signal (stop closed; caught says which) ends a rendezvous
// still waiting, as an interrupted job.
func trainRank(env dist.Env, cfg *trainer.Config, stop <-chan struct{}, caught func() os.Signal) error {
	flat, err := dist.FlattenConfig(cfg)
	if err != nil {
		return err
	}
	token, err := dist.TokenFromEnv(os.Getenv)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "student train: %s\n", env)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	g, err := dist.Join(ctx, env, dist.Options{Config: flat, Token: token, Log: os.Stderr})
	if ss, ok := caught().(syscall.Signal); ok && err != nil {
		return &cli.Interrupted{Signal: ss, Msg: fmt.Sprintf("stopped by %s during the rendezvous: nothing to save (%v)", sigName(ss), err)}
	}
	if err != nil {
		return err
	}
	defer g.Close()
	return fmt.Errorf("rank %d of %d: the rendezvous succeeded (config %.12s), but data-parallel training is not implemented yet (issue 25): train with one process", g.Rank(), g.WorldSize(), g.ConfigHash())
}

// withoutFlag is args without flag name and its value, in any of the
// forms package flag takes (-name v, --name v, -name=v, --name=v).
func withoutFlag(args []string, name string) []string {
	var out []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(out, args[i:]...)
		}
		trimmed := strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-")
		switch {
		case trimmed == name && trimmed != a:
			i++ // its value
		case strings.HasPrefix(trimmed, name+"=") && trimmed != a:
		default:
			out = append(out, a)
		}
	}
	return out
}
