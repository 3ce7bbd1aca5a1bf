// Command teacherd is the teacher daemon: it loads an HF checkpoint once
// and serves the distill.v1.Teacher gRPC API (top-k scoring, cache fills,
// status), with gRPC health and reflection, Prometheus metrics on
// /metrics, structured logs, and a graceful drain on SIGTERM.
//
//	teacherd --model /ckpt/Qwen3-8B --cache /data/cache-a --data-root /data/sets
//	teacherd --model /ckpt/Qwen3-8B --cache /data/cache-a --data-root /data/sets \
//	    --listen 0.0.0.0:7070 --token-file /etc/teacherd/token --tls-cert c.pem --tls-key k.pem
//	teacherd --config teacherd.yaml
//	teacherd --model /ckpt/Llama-3-70B --devices 0,1 --cache /data/cache-b --data-root /data/sets
//	teacherd --plan --model /ckpt/Llama-3-70B --devices 0,1 --device-memory 80GiB
//
// --devices splits a teacher larger than one GPU over several, a pipeline
// stage each; --plan prints that split and each GPU's memory by term
// (from config.json alone: no weights read, no GPU needed) and exits,
// 1 when the teacher does not fit, with an error naming the GPU.
//
// Clients name dataset files on the daemon's machine: only files under a
// --data-root are readable (none: no file). The daemon listens on
// loopback unless told otherwise, and refuses an address other machines
// can reach without --token-file or TLS, unless --insecure.
//
// Flags override the YAML config (keys: see serve.Config).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"go.uber.org/zap"

	"distill/compute/device"
	"distill/internal/cli"
	"distill/serve"
)

func main() {
	device.EnsureCPUCore(os.Stderr)
	if err := run(os.Args[1:]); err != nil {
		if !errors.Is(err, flag.ErrHelp) { // for help, the flag set printed the usage
			fmt.Fprintln(os.Stderr, "teacherd:", err)
		}
		// cachectl's and student's statuses: 0 for --help, 2 for a
		// usage error, 1 for any other failure.
		os.Exit(cli.ExitStatus(err))
	}
}

func run(args []string) error {
	cfg, logJSON, plan, err := parseConfig(args)
	if err != nil {
		return err
	}
	if plan.on {
		return printPlan(os.Stdout, cfg, plan)
	}
	zc := zap.NewProductionConfig()
	if !logJSON {
		zc = zap.NewDevelopmentConfig()
		zc.DisableStacktrace = true
	}
	log, err := zc.Build()
	if err != nil {
		return err
	}
	defer log.Sync()
	// Signals are caught before the model loads, so a SIGTERM during
	// loading still ends in a clean shutdown (exit 0) once Start returns.
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	d, err := serve.Start(cfg, log)
	if err != nil {
		return err
	}
	<-ctx.Done()
	// A second signal during the drain gets Go's default action and ends
	// the process at once, for an operator who cannot wait.
	stop()
	log.Info("signal received: draining (a second signal exits immediately)")
	if err := d.Shutdown(context.Background()); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}

// planFlags are --plan's own flags.
type planFlags struct {
	on            bool
	deviceMemory  string
	memoryFromGPU bool // --device-memory not given
}

// parseConfig reads the flags and the YAML file they name; flags given
// explicitly override the file.
func parseConfig(args []string) (serve.Config, bool, planFlags, error) {
	var pf planFlags
	fs := flag.NewFlagSet("teacherd", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage)
		fs.PrintDefaults()
	}
	config := fs.String("config", "", "YAML config file (flags override it)")
	var f serve.Config
	fs.StringVar(&f.Model, "model", "", "HF checkpoint directory (config.json + *.safetensors)")
	fs.StringVar(&f.Tokenizer, "tokenizer", "", "tokenizer directory (default: the model directory; without tokenizer.json only pre-tokenized data)")
	fs.StringVar(&f.Listen, "listen", "", "gRPC listen address (default 127.0.0.1:7070)")
	fs.StringVar(&f.Metrics, "metrics", "", `Prometheus /metrics address (default 127.0.0.1:9090, "off" to disable)`)
	fs.StringVar(&f.Cache, "cache", "", "cache directory fills write, created if missing (empty: Fill disabled)")
	fs.Var((*stringList)(&f.DataRoots), "data-root", "directory `DIR` whose files clients may name as datasets (repeatable; none: Fill and DescribeDataset are refused)")
	fs.StringVar(&f.Device, "device", "", "compute device: auto (a GPU when one opens, else the CPU), cpu or cuda")
	fs.StringVar(&f.Weights, "weights", "", "the layers' Linear weights: bf16 (default: as the checkpoint gives them) or fp8 (E4M3 with a scale per output channel, quantized at load; W8A8 FP8 GEMMs on a GPU of compute capability 8.9 or later, Ada or Hopper; a different fingerprint: see the README's FP8 fidelity table)")
	fs.StringVar(&f.Devices, "devices", "", "split the teacher's layers over these GPUs, a pipeline stage each: ordinals 0,1,2,3 (one may repeat: two stages on one GPU) or all")
	fs.IntVar(&f.MicroBatches, "micro-batches", 0, "micro-batches a pipelined forward is cut into (default: four a GPU, none under 1024 tokens)")
	fs.BoolVar(&pf.on, "plan", false, "print the teacher's memory plan for --devices (its layers over the GPUs, each GPU's bytes by term, the largest token budget) from config.json alone, and exit")
	fs.StringVar(&pf.deviceMemory, "device-memory", "", "with --plan: each GPU's memory, e.g. 80GiB (default: GPU 0's when one is visible, else 80GiB)")
	fs.IntVar(&f.TokenBudget, "token-budget", 0, "tokens per forward pass (default 8192); on a GPU, checked at start against its free memory")
	fs.IntVar(&f.MaxConcurrent, "max-concurrent", 0, "concurrent RPCs before ResourceExhausted (default 64)")
	fs.IntVar(&f.QueueSamples, "queue-samples", 0, "queued samples before ResourceExhausted (default 1024)")
	fs.IntVar(&f.QueueTokens, "queue-tokens", 0, "queued tokens before ResourceExhausted (default 8 token budgets)")
	fs.IntVar(&f.KDefault, "k-default", 0, "k of requests that give none (default 64)")
	fs.IntVar(&f.KMax, "k-max", 0, "largest k accepted (default min(vocab, 4096))")
	fs.IntVar(&f.MaxDraws, "max-draws", 0, "most draws per position a fill or score of sampled targets may ask for (default 64, at most 4096); on a GPU, the memory check at start plans for it")
	fs.StringVar(&f.TLSCert, "tls-cert", "", "TLS certificate (PEM); with --tls-key enables TLS")
	fs.StringVar(&f.TLSKey, "tls-key", "", "TLS private key (PEM)")
	fs.StringVar(&f.TokenFile, "token-file", "", "file holding the bearer token clients must send (empty: no auth)")
	fs.BoolVar(&f.Insecure, "insecure", false, "allow a --listen address other machines can reach without --token-file or TLS (a trusted network only)")
	fs.DurationVar(&f.DrainTimeout, "drain-timeout", 0, "graceful shutdown: time in-flight requests get to finish (default 30s)")
	logJSON := fs.Bool("log-json", false, "JSON logs (default: console)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return f, false, pf, err
	}
	if fs.NArg() > 0 {
		return f, false, pf, cli.Usagef("unexpected arguments %q", fs.Args())
	}
	pf.memoryFromGPU = pf.deviceMemory == ""
	if !pf.on && pf.deviceMemory != "" {
		return f, false, pf, cli.Usagef("--device-memory is for --plan: a running teacherd measures its GPUs' memory")
	}
	// The values of the flags given, before the config file is read: a
	// bad one is what the command line alone gets wrong, a usage error
	// (exit 2); serve.Start, which sees the flags and the file merged,
	// would refuse it as a bad configuration (exit 1).
	given := map[string]bool{}
	var bad error
	fs.Visit(func(fl *flag.Flag) {
		given[fl.Name] = true
		if bad == nil {
			bad = f.CheckSetting(fl.Name)
		}
	})
	if bad != nil {
		return f, false, pf, cli.Usage(bad)
	}
	cfg := f
	if *config != "" {
		var err error
		if cfg, err = serve.LoadConfig(*config); err != nil {
			return cfg, false, pf, err
		}
		// The file's values that no flag overrides: a bad one is the
		// file's (exit 1), named by its key (cfg.Sources).
		fs.VisitAll(func(fl *flag.Flag) {
			if bad == nil && !given[fl.Name] {
				bad = cfg.CheckSetting(fl.Name)
			}
		})
		if bad != nil {
			return cfg, false, pf, bad
		}
		fs.Visit(func(fl *flag.Flag) {
			overrideFlag(&cfg, &f, fl.Name)
			delete(cfg.Sources.FromFile, fl.Name) // named by its flag from here on
		})
	}
	// Values that must agree, merged: --k-default above --k-max, or
	// --tls-cert without --tls-key, are the command line's mistake
	// (exit 2) when a flag given is one of them, else the file's (1).
	if pair, err := cfg.CheckPairs(); err != nil {
		if slices.ContainsFunc(pair, func(name string) bool { return given[name] }) {
			err = cli.Usage(err)
		}
		return cfg, false, pf, err
	}
	return cfg, *logJSON, pf, nil
}

// overrideFlag copies the flag named name from f into cfg.
func overrideFlag(cfg, f *serve.Config, name string) {
	switch name {
	case "model":
		cfg.Model = f.Model
	case "tokenizer":
		cfg.Tokenizer = f.Tokenizer
	case "listen":
		cfg.Listen = f.Listen
	case "metrics":
		cfg.Metrics = f.Metrics
	case "cache":
		cfg.Cache = f.Cache
	case "device":
		cfg.Device = f.Device
	case "weights":
		cfg.Weights = f.Weights
	case "devices":
		cfg.Devices = f.Devices
	case "micro-batches":
		cfg.MicroBatches = f.MicroBatches
	case "token-budget":
		cfg.TokenBudget = f.TokenBudget
	case "max-concurrent":
		cfg.MaxConcurrent = f.MaxConcurrent
	case "queue-samples":
		cfg.QueueSamples = f.QueueSamples
	case "queue-tokens":
		cfg.QueueTokens = f.QueueTokens
	case "k-default":
		cfg.KDefault = f.KDefault
	case "k-max":
		cfg.KMax = f.KMax
	case "max-draws":
		cfg.MaxDraws = f.MaxDraws
	case "tls-cert":
		cfg.TLSCert = f.TLSCert
	case "tls-key":
		cfg.TLSKey = f.TLSKey
	case "token-file":
		cfg.TokenFile = f.TokenFile
	case "data-root":
		cfg.DataRoots = f.DataRoots
	case "insecure":
		cfg.Insecure = f.Insecure
	case "drain-timeout":
		cfg.DrainTimeout = f.DrainTimeout
	}
}

const usage = `teacherd serves a teacher model over gRPC (distill.v1.Teacher).

  teacherd --model DIR --cache DIR --data-root DIR [flags]
  teacherd --config teacherd.yaml [flags]

Security: clients name dataset files on this machine, and only files under
a --data-root are readable (no --data-root: none). The daemon listens on
127.0.0.1 by default; an address other machines can reach needs
--token-file (and TLS: --tls-cert, --tls-key), or --insecure.

Exit status: 0 once a SIGTERM or Ctrl-C has drained the daemon (and for
-h); 1 when it fails (a bad config file or value, a model that does not
load, an address in use; --plan: a teacher that does not fit); 2 for a
usage error (an unknown flag, a bad flag value, unexpected arguments).

Flags (they override the config file):
`

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(v string) error {
	*l = append(*l, v)
	return nil
}
