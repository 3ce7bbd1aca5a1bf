// Package device resolves a --device flag to a compute.Backend. It is the
// one place that imports the concrete backends: the teacher, the student
// and the daemon see only compute.Backend.
package device

import (
	"errors"
	"fmt"

	"distill/compute"
	"distill/compute/cpu"
)

// ErrDevice is wrapped by every error of Open.
var ErrDevice = errors.New("device: unavailable")

// Names lists the values Open accepts.
const Names = "auto, cpu or cuda"

// Open returns the backend a --device flag names:
//
//   - "auto" (or ""): a GPU when this build has a GPU backend and one is
//     present, else the CPU; this build has no GPU backend, so the CPU;
//   - "cpu": the reference backend (compute/cpu);
//   - "cuda": refused, this build has no CUDA backend yet.
//
// threads caps the CPU backend's worker goroutines (0: one per core).
func Open(name string, threads int) (compute.Backend, error) {
	if threads < 0 {
		return nil, fmt.Errorf("%w: %d threads: want 0 (all cores) or more", ErrDevice, threads)
	}
	if err := Check(name); err != nil {
		return nil, err
	}
	return cpu.New(threads), nil
}

// Check reports whether Open accepts name (a config's validation, before
// anything is opened).
func Check(name string) error {
	switch name {
	case "", "auto", "cpu":
		return nil
	case "cuda":
		return fmt.Errorf("%w: --device cuda: this build has no CUDA backend yet; use --device cpu (or auto)", ErrDevice)
	}
	return fmt.Errorf("%w: --device %q: want %s", ErrDevice, name, Names)
}

// CPU returns the CPU backend with threads workers (0: one per core), for
// callers that need no flag (tools, tests, the student's defaults).
func CPU(threads int) compute.Backend { return cpu.New(threads) }
