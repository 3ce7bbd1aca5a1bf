package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"

	"distill/compute"
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
	argv, err := json.Marshal(os.Args)
	if err != nil {
		return err
	}
	environ := append(os.Environ(), envLauncherArgv+"="+string(argv))
	return dist.Launch(dist.LaunchOptions{NProc: n, Args: append([]string{"train"}, withoutFlag(args, "nproc-per-node")...), Env: environ})
}

// envLauncherArgv holds, in each rank --nproc-per-node starts, the
// launcher's command line (a JSON array): the job's command, which a
// rank's "resume with" prints instead of its own (the rank's has no
// --nproc-per-node, and run as printed it resumed the job as one
// process).
const envLauncherArgv = "DISTILL_STUDENT_LAUNCHER_ARGV"

// jobArgv is the command line that runs this job: the launcher's in a
// rank --nproc-per-node started, else this process's.
func jobArgv() []string {
	if v := os.Getenv(envLauncherArgv); v != "" && os.Getenv("RANK") != "" {
		var argv []string
		if json.Unmarshal([]byte(v), &argv) == nil && len(argv) > 0 {
			return argv
		}
	}
	return os.Args
}

// rankOf makes this process rank env.Rank of a data-parallel run
// (trainer.Parallel): its Join, called by the trainer once the rank's GPU
// (its local rank) is open, joins the rendezvous with the resolved config
// (rank 0 makes the NCCL id on its GPU and hands it out), then the NCCL
// group. A signal (stop closed) ends a rendezvous still waiting. Once
// joined, a rank that dies or hangs ends this one: the rendezvous's
// control plane sees it, and NCCL would wait for it forever. leave ends
// the rank's part in the control plane with the outcome of its run (see
// there).
func rankOf(env dist.Env, cfg *trainer.Config, stop <-chan struct{}) (p *trainer.Parallel, leave func(runErr error) error, err error) {
	flat, err := dist.FlattenConfig(cfg)
	if err != nil {
		return nil, nil, err
	}
	token, err := dist.TokenFromEnv(os.Getenv)
	if err != nil {
		return nil, nil, err
	}
	fmt.Fprintf(os.Stderr, "student train: %s\n", env)
	var (
		g       *dist.Group
		leaving atomic.Bool // the group's end is this rank's own doing
	)
	join := func(be compute.Backend) (compute.Collective, error) {
		cb, ok := be.(compute.Collectives)
		if !ok {
			// An unset train.device is auto: it printed as train.device "".
			dev := cfg.Train.Device
			if dev == "" {
				dev = "auto (the default)"
			}
			return nil, fmt.Errorf("data-parallel training runs on GPUs through NCCL, and train.device %s opened the %s backend, which has no collectives: set train.device: cuda", dev, be.Name())
		}
		o := dist.Options{Config: flat, Token: token, Log: os.Stderr}
		if env.Rank == 0 {
			o.UniqueID = func() ([]byte, error) {
				id, err := cb.NewCollectiveID()
				return id[:], err
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		joined := make(chan struct{})
		go func() {
			select {
			case <-stop:
				cancel()
			case <-joined:
			}
		}()
		g, err = dist.Join(ctx, env, o)
		close(joined)
		cancel()
		if err != nil {
			return nil, err
		}
		go func() {
			<-g.Done()
			if err := g.Err(); err != nil && !leaving.Load() {
				fmt.Fprintf(os.Stderr, "student train: rank %d: %v: ending this rank (its peers' collectives would wait forever)\n", env.Rank, err)
				os.Exit(1)
			}
		}()
		var id compute.CollectiveID
		copy(id[:], g.UniqueID())
		return cb.JoinCollective(id, g.Rank(), g.WorldSize())
	}
	// leave: a rank whose run failed aborts the group, naming itself, so
	// that the others stop at once; a rank whose run ended (done, or
	// stopped with the others at one step) waits for every rank to end
	// theirs before it closes the group. Closing at once raced the
	// others' end: rank 0's goodbye reached a rank still writing its last
	// log line, whose watcher took the closed group for a dead peer and
	// exited 1 (TestSIGTERMOneRankStopsTheJob caught it). After the
	// barrier a goodbye is the job's end.
	leave = func(runErr error) error {
		if g == nil {
			return nil
		}
		leaving.Store(true)
		if runErr != nil {
			g.Abort(runErr)
			return nil
		}
		if err := g.Barrier(context.Background()); err != nil {
			return fmt.Errorf("rank %d ended its run, but the job did not: %w", env.Rank, err)
		}
		return g.Close()
	}
	return &trainer.Parallel{Rank: env.Rank, WorldSize: env.WorldSize, LocalRank: env.LocalRank, Join: join}, leave, nil
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
