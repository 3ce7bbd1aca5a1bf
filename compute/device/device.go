// Package device resolves a --device flag to a compute.Backend. It is the
// one place that imports the concrete backends: the teacher, the student
// and the daemon see only compute.Backend.
//
// What a flag opens depends on what the backend is for:
//
//	--device   Inference (teacher forward) and training (student)
//	auto       CUDA if a GPU's backend opens, else the CPU
//	cpu        the CPU
//	cuda       CUDA, or an error naming what is missing (driver, NVRTC,
//	           cuBLASLt, a GPU)
//
// The CUDA backend's training path passed the GPU suite on an H200
// (2026-11-26: conformance, memcheck, loss curves within 0.3% of the CPU's,
// bit-exact resume and QAD export), so auto trains on a GPU when there is
// one, as it runs the teacher there.
//
// auto's choice, and why, is one line to Options.Logf.
package device

import (
	"errors"
	"fmt"
	"io"

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
	// Ordinal is the GPU a CUDA backend opens (0: the first; a
	// data-parallel rank's local rank).
	Ordinal int
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
	openCUDA := func() (compute.Backend, error) { return cuda.Open(cuda.Options{Device: o.Ordinal, Logf: logf}) }
	switch name {
	case "cuda":
		be, err := openCUDA()
		if err != nil {
			return nil, fmt.Errorf("%w: --device cuda: %w", ErrDevice, err)
		}
		return be, nil
	case "", "auto":
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
		logf("device auto: using %s (cuda) for %s", gpu.Name, o.Purpose)
		return be, nil
	}
	return cpu.New(o.Threads), nil
}

// ForwardScratchBound bounds the kernel scratch of a teacher forward of
// shape s on a GPU (the CUDA backend with cuDNN), without one: the memory
// plan of a teacher made on paper (cachectl plan).
func ForwardScratchBound(s compute.ForwardShape) int64 { return cuda.ForwardScratchBound(s) }

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

// EnsureCPUCore makes OpenBLAS run the best kernels the CPU supports,
// re-executing the program when it picked weaker ones (cpu.EnsureCore;
// DISTILL_OPENBLAS_AUTOCORE=0 turns it off). Commands call it first in
// main.
func EnsureCPUCore(log io.Writer) { cpu.EnsureCore(log) }
