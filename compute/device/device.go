// Package device resolves a --device flag to a compute.Backend. It is the
// one place that imports the concrete backends: the teacher, the student
// and the daemon see only compute.Backend.
//
// What a flag opens depends on what the backend is for:
//
//	--device   Inference (teacher forward)        Training (student)
//	auto       CUDA if a GPU opens, else the CPU  the CPU (see below)
//	cpu        the CPU                            the CPU
//	cuda       CUDA, or an error naming what      CUDA (explicit opt-in), or
//	           is missing (driver, NVRTC,         the same errors
//	           cuBLASLt, a GPU)
//
// The CUDA backend's training kernels are written and pass the
// conformance suite on the CPU emulator of CUDA, but have not run on a GPU
// yet (issue 16): --device cuda trains there with a log line saying so, and
// auto keeps training on the CPU until the GPU suite (scripts/gpu-suite.sh)
// has passed on a GPU.
//
// auto's choice, and why, is one line to Options.Logf.
package device

import (
	"errors"
	"fmt"

	"distill/compute"
	"distill/compute/cpu"
	"distill/compute/cuda"
)

// ErrDevice is wrapped by every error of Open and Check.
var ErrDevice = errors.New("device: unavailable")

// Names lists the values Open accepts.
const Names = "auto, cpu or cuda"

// Purpose is what a backend is opened for.
type Purpose uint8

const (
	// Inference is the teacher's forward (teacherd, cachectl fill and
	// score): the forward kernels only.
	Inference Purpose = iota
	// Training is the student's forward, backward and optimizer: the
	// whole contract.
	Training
)

func (p Purpose) String() string {
	if p == Training {
		return "training"
	}
	return "inference"
}

// Options configure Open.
type Options struct {
	// Purpose is what the backend will run; the zero value is Inference.
	Purpose Purpose
	// Threads caps the CPU backend's worker goroutines (0: one per core).
	Threads int
	// Logf, if set, receives one line per notable event: the backend auto
	// chose and why (the GPU found, or why none is used), the GPU opened
	// and its kernels compiled or read from the cache.
	Logf func(format string, args ...any)
}

// Open returns the backend a --device flag names, for o.Purpose (see the
// package doc's table). A CUDA backend is released with the process (or
// with Close).
func Open(name string, o Options) (compute.Backend, error) {
	if o.Threads < 0 {
		return nil, fmt.Errorf("%w: %d threads: want 0 (all cores) or more", ErrDevice, o.Threads)
	}
	if err := Check(name, o.Purpose); err != nil {
		return nil, err
	}
	logf := o.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	openCUDA := func() (compute.Backend, error) { return cuda.Open(cuda.Options{Logf: logf}) }
	switch name {
	case "cuda":
		be, err := openCUDA()
		if err != nil {
			return nil, fmt.Errorf("%w: --device cuda: %w", ErrDevice, err)
		}
		if o.Purpose == Training {
			logf("device cuda: %s", TrainingUnverified)
		}
		return be, nil
	case "", "auto":
		if o.Purpose == Training {
			if gpu, err := cuda.Probe(); err == nil {
				logf("device auto: %s found, but auto trains on the CPU until the CUDA training path has passed the GPU suite (issue 16); --device cuda trains on the GPU", gpu.Name)
			} else {
				logf("device auto: training on the CPU")
			}
			return cpu.New(o.Threads), nil
		}
		gpu, err := cuda.Probe()
		if err != nil {
			logf("device auto: no usable GPU (%v): using the CPU", err)
			return cpu.New(o.Threads), nil
		}
		be, err := openCUDA()
		if err != nil {
			logf("device auto: %s found, but the CUDA backend does not open (%v): using the CPU", gpu.Name, err)
			return cpu.New(o.Threads), nil
		}
		logf("device auto: using %s (cuda)", gpu.Name)
		return be, nil
	}
	return cpu.New(o.Threads), nil
}

// TrainingUnverified is the line --device cuda logs when it opens the CUDA
// backend for training.
const TrainingUnverified = "training on the GPU: the CUDA training kernels pass the conformance suite on the CPU emulator, but this path has not been verified on a GPU yet (issue 16); --device cpu is the verified path"

// Check reports whether Open accepts name for p, before anything is
// opened (a config's validation).
func Check(name string, p Purpose) error {
	switch name {
	case "", "auto", "cpu", "cuda":
		return nil
	}
	return fmt.Errorf("%w: --device %q: want %s", ErrDevice, name, Names)
}

// Close releases what a backend holds beyond its tensors (a CUDA backend's
// stream, kernels and library handles); for the CPU backend it does
// nothing.
func Close(be compute.Backend) error {
	if c, ok := be.(interface{ Close() error }); ok {
		return c.Close()
	}
	return nil
}

// CPU returns the CPU backend with threads workers (0: one per core), for
// callers that need no flag (tools, tests, the student's defaults).
func CPU(threads int) compute.Backend { return cpu.New(threads) }
