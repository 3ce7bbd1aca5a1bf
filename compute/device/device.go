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
	"os"
	"strconv"
	"strings"

	"distill/compute"
	"distill/compute/cpu"
	"distill/compute/cuda"
	"distill/internal/errkind"
)

// ErrDevice is in the chain of every error of Open, OpenStages, Check,
// CheckSetting, CheckStages, ParseDevices and CheckDevices (errors.Is);
// its text is not in their messages, which name the flag (or config key)
// and what to do.
var ErrDevice = errors.New("device: unavailable")

// Names lists the values Open accepts.
const Names = "auto, cpu or cuda"

// Purpose is what a backend is opened for.
type Purpose uint8

const (
	// Inference is the teacher's forward (teacherd, cachectl fill and
	// score) and the student's in student eval: no training step.
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
	// Setting is what the user set the name with, named in errors: a
	// flag ("": --device) or a config key (the trainer's train.device,
	// or teacherd's "config FILE: device:").
	Setting string
}

// said is the name as the user set it: "--device cuda", or
// "train.device cuda" for a config key.
func (o Options) said(name string) string {
	if o.Setting == "" {
		return "--device " + name
	}
	return o.Setting + " " + name
}

// use says how to set the name instead: "use --device cpu", or "set
// train.device: cpu".
func (o Options) use(name string) string {
	if o.Setting == "" || strings.HasPrefix(o.Setting, "-") {
		return "use " + o.said(name)
	}
	return "set " + o.Setting + ": " + name
}

// Open returns the backend a --device flag names, for o.Purpose (see the
// package doc's table). A CUDA backend is released with the process (or
// with Close).
func Open(name string, o Options) (compute.Backend, error) {
	if o.Threads < 0 {
		return nil, errkind.Errorf(ErrDevice, "%d threads: want 0 (all cores) or more", o.Threads)
	}
	if err := check(name, o); err != nil {
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
			return nil, errkind.Reword(ErrDevice, err, "%s: %s; without a GPU, %s", o.said("cuda"), cudaText(err), o.use("cpu"))
		}
		return be, nil
	case "", "auto":
		gpu, err := cuda.Probe()
		switch {
		case errors.Is(err, cuda.ErrNotInstalled):
			// The usual machine without a GPU: one short line, not the
			// loader's search (--device cuda gives it in full).
			logf("device auto: no GPU driver on this machine (no libcuda.so.1): using the CPU")
			return cpu.New(o.Threads), nil
		case err != nil:
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

// OpenStages opens one backend per entry of ords (GPU ordinals, as
// ParseDevices reads them) for the stages of a pipelined teacher: a
// CUDA backend on each GPU, a repeated ordinal a second backend (a stream
// of its own) on the same GPU. name is the --device flag: cuda or auto
// (both need the GPUs: --devices never falls back to the CPU); cpu is an
// error. An error names the GPU that does not open, and what was opened
// is closed.
func OpenStages(name string, ords []int, o Options) ([]compute.Backend, error) {
	if err := CheckStages(name, ords); err != nil {
		return nil, err
	}
	logf := o.Logf
	if logf == nil {
		logf = func(string, ...any) {}
	}
	var bes []compute.Backend
	for _, ord := range ords {
		be, err := cuda.Open(cuda.Options{Device: ord, Logf: logf})
		if err != nil {
			for _, b := range bes {
				Close(b)
			}
			return nil, stageError(ords, ord, err)
		}
		bes = append(bes, be)
	}
	return bes, nil
}

// CheckStages reports whether OpenStages can place stages on ords with
// the --device flag name, before anything is opened (a daemon checks it
// before it listens): --devices needs cuda or auto.
func CheckStages(name string, ords []int) error {
	if err := Check(name, Inference); err != nil {
		return err
	}
	if len(ords) == 0 {
		return errkind.Errorf(ErrDevice, "--devices names no GPU")
	}
	if name == "cpu" {
		return cpuStages(ordList(ords))
	}
	return nil
}

// CheckStagesOf is CheckStages for the --devices value spec as given
// (ordinals or all), before ParseDevices reads it: all's GPUs are
// counted only once the driver loads, and --device cpu --devices all
// said the CUDA driver would not load, not that the flags exclude each
// other. An empty spec is no stage: nothing to check beyond the name.
func CheckStagesOf(name, spec string) error {
	if err := Check(name, Inference); err != nil {
		return err
	}
	if spec = strings.TrimSpace(spec); spec != "" && name == "cpu" {
		return cpuStages(spec)
	}
	return nil
}

// cpuStages is the error of --device cpu with --devices spec.
func cpuStages(spec string) error {
	return errkind.Errorf(ErrDevice, "--device cpu --devices %s: --devices places the teacher's layers on GPUs: use --device cuda (or auto) with it, or leave --devices out to run on the CPU", spec)
}

// stageError is OpenStages' error for GPU ord of ords, whose CUDA backend
// did not open with err.
func stageError(ords []int, ord int, err error) error {
	var nd *cuda.NoDeviceError
	if errors.As(err, &nd) {
		gpus := "1 GPU: 0"
		switch {
		case nd.Count == 2:
			gpus = "2 GPUs: 0,1"
		case nd.Count > 2:
			gpus = fmt.Sprintf("%d GPUs: 0-%d", nd.Count, nd.Count-1)
		}
		has := "this machine has " + gpus
		if v, ok := os.LookupEnv("CUDA_VISIBLE_DEVICES"); ok {
			has = fmt.Sprintf("this process sees %s, of CUDA_VISIBLE_DEVICES=%s", gpus, v)
		}
		return errkind.Reword(ErrDevice, err, "--devices %s: GPU %d does not exist (%s): name only those, or --devices all", ordList(ords), ord, has)
	}
	return errkind.Reword(ErrDevice, err, "--devices %s: GPU %d does not open: %s; without GPUs, leave --devices out and use --device cpu", ordList(ords), ord, cudaText(err))
}

// ordList writes GPU ordinals as --devices takes them: 0,1,2.
func ordList(ords []int) string {
	s := make([]string, len(ords))
	for i, o := range ords {
		s[i] = strconv.Itoa(o)
	}
	return strings.Join(s, ",")
}

// cudaText is a CUDA backend's error without the "cuda: " its package
// writes in front of it: the flag named before it says cuda already.
func cudaText(err error) string { return strings.TrimPrefix(err.Error(), "cuda: ") }

// GPUMemory names GPU 0 and gives its memory, or the error that says why
// no GPU is usable (a plan's default device memory).
func GPUMemory() (name string, total int64, err error) {
	info, err := cuda.Probe()
	if err != nil {
		return "", 0, err
	}
	return fmt.Sprintf("GPU 0 (%s, %.2f GiB)", info.Name, float64(info.TotalMem)/(1<<30)), info.TotalMem, nil
}

// ForwardScratchBound bounds the kernel scratch of a teacher forward of
// shape s on a GPU (the CUDA backend with cuDNN), without one: the memory
// plan of a teacher made on paper (cachectl plan).
func ForwardScratchBound(s compute.ForwardShape) int64 { return cuda.ForwardScratchBound(s) }

// ForwardScratchTerms is ForwardScratchBound by term: the decoder layers'
// largest kernel scratch and the LM head's (never held at once).
func ForwardScratchTerms(s compute.ForwardShape) (layers, head int64) {
	return cuda.ForwardScratchTerms(s)
}

// ParseDevices reads a --devices flag: GPU ordinals separated by commas
// ("0,1,2,3"; an ordinal may repeat, for stages sharing a GPU), or "all",
// every GPU the CUDA driver sees. "" is none.
func ParseDevices(spec string) ([]int, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return nil, nil
	}
	if spec == "all" {
		n, err := cuda.DeviceCount()
		if err != nil {
			return nil, errkind.Reword(ErrDevice, err, "--devices all: %s", cudaText(err))
		}
		if n == 0 {
			return nil, errkind.Errorf(ErrDevice, "--devices all: the driver sees no GPU: leave --devices out to run on one device (--device cpu without a GPU)")
		}
		ords := make([]int, n)
		for i := range ords {
			ords[i] = i
		}
		return ords, nil
	}
	return parseOrdinals(spec, "--devices")
}

// CheckDevices checks the form of a --devices value as ParseDevices
// reads it, GPU ordinals separated by commas or all, without the driver
// (all's GPUs are not counted: ParseDevices does that). Its error names
// the value as setting sets it: "--devices", or a config key.
func CheckDevices(spec, setting string) error {
	spec = strings.TrimSpace(spec)
	if spec == "" || spec == "all" {
		return nil
	}
	_, err := parseOrdinals(spec, setting)
	return err
}

// parseOrdinals reads GPU ordinals separated by commas; an error names
// spec as setting sets it.
func parseOrdinals(spec, setting string) ([]int, error) {
	var ords []int
	for _, f := range strings.Split(spec, ",") {
		o, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || o < 0 {
			return nil, errkind.Errorf(ErrDevice, "%s %q: want GPU ordinals separated by commas (0,1,2,3) or all", setting, spec)
		}
		ords = append(ords, o)
	}
	return ords, nil
}

// PlanDevices reads the --devices flag of a plan on paper: ordinals as
// ParseDevices takes them, or a bare count N (GPUs 0..N-1); "" is one
// GPU.
func PlanDevices(spec string) ([]int, error) {
	spec = strings.TrimSpace(spec)
	if spec == "" {
		return []int{0}, nil
	}
	if n, err := strconv.Atoi(spec); err == nil {
		if n < 1 {
			return nil, errkind.Errorf(ErrDevice, "--devices %d: want a count of at least 1, or ordinals (0,1)", n)
		}
		ords := make([]int, n)
		for i := range ords {
			ords[i] = i
		}
		return ords, nil
	}
	if spec == "all" {
		return nil, errkind.Errorf(ErrDevice, "--devices all: a plan on paper needs ordinals or a count")
	}
	ords, err := ParseDevices(spec)
	if err != nil {
		return nil, err
	}
	// A running teacher may put two stages on one GPU (a pipeline tried
	// on one device); a plan gives each stage a GPU's whole memory.
	seen := map[int]bool{}
	for _, o := range ords {
		if seen[o] {
			return nil, errkind.Errorf(ErrDevice, "--devices %q names GPU %d twice: a plan on paper gives every stage a GPU of its own; name distinct GPUs (or a count)", spec, o)
		}
		seen[o] = true
	}
	return ords, nil
}

// Check reports whether Open accepts name for p, before anything is
// opened (a config's validation).
func Check(name string, p Purpose) error { return check(name, Options{Purpose: p}) }

// CheckSetting is Check for o.Purpose, its error naming the name as
// o.Setting sets it, as Open's do: `train.device "tpu": want auto, cpu
// or cuda`.
func CheckSetting(name string, o Options) error { return check(name, o) }

// check is Check naming o.Setting.
func check(name string, o Options) error {
	switch name {
	case "", "auto", "cpu", "cuda":
		return nil
	}
	return errkind.Errorf(ErrDevice, "%s: want %s", o.said(strconv.Quote(name)), Names)
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
