package device

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute/cuda"
	"distill/compute/cuda/cudaemu"
)

// logLines collects Options.Logf's lines.
type logLines []string

func (l *logLines) logf(format string, args ...any) { *l = append(*l, fmt.Sprintf(format, args...)) }

func (l logLines) has(t *testing.T, want string) {
	t.Helper()
	for _, s := range l {
		if strings.Contains(s, want) {
			return
		}
	}
	t.Errorf("no log line mentions %q: %q", want, []string(l))
}

// noDriver makes this process see no NVIDIA driver, on any machine: the
// driver's library is a file that does not exist.
func noDriver(t *testing.T) string {
	missing := filepath.Join(t.TempDir(), "libcuda.so.1")
	t.Setenv("DISTILL_LIBCUDA", missing)
	return missing
}

func TestCheck(t *testing.T) {
	for _, p := range []Purpose{Inference, Training} {
		for _, name := range []string{"", "auto", "cpu"} {
			if err := Check(name, p); err != nil {
				t.Errorf("Check(%q, %v): %v", name, p, err)
			}
		}
		if err := Check("tpu", p); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), `"tpu"`) {
			t.Errorf("Check(tpu, %v): %v", p, err)
		}
	}
	for _, p := range []Purpose{Inference, Training} {
		if err := Check("cuda", p); err != nil {
			t.Errorf("Check(cuda, %v): %v", p, err)
		}
	}
}

// TestOpenWithoutGPU is this machine's case: no driver. cuda fails naming
// the missing library; auto falls back to the CPU and says why.
func TestOpenWithoutGPU(t *testing.T) {
	missing := noDriver(t)
	for _, name := range []string{"", "auto", "cpu"} {
		var log logLines
		be, err := Open(name, Options{Threads: 2, Logf: log.logf})
		if err != nil || be.Name() != "cpu" {
			t.Fatalf("Open(%q): %v %v", name, be, err)
		}
		if name != "cpu" {
			log.has(t, "no usable GPU")
			log.has(t, missing) // why: the driver's library is not there
			log.has(t, "using the CPU")
		}
	}
	_, err := Open("cuda", Options{})
	for _, want := range []string{missing, "DISTILL_LIBCUDA", "--device cuda: ", "; without a GPU, use --device cpu"} {
		if !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), want) {
			t.Errorf("Open(cuda) without a driver = %v, want ErrDevice mentioning %q", err, want)
		}
	}
	// Set by a config key, the error names the key and how to set the
	// CPU there, not the --device flag.
	_, err = Open("cuda", Options{Purpose: Training, Setting: "train.device"})
	for _, want := range []string{"train.device cuda: ", missing, "; without a GPU, set train.device: cpu"} {
		if !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "--device") {
			t.Errorf("Open(cuda) set by train.device without a driver = %v, want ErrDevice mentioning %q and no --device", err, want)
		}
	}
	if _, err := Open("tpu", Options{Setting: "train.device"}); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), `train.device "tpu": want auto, cpu or cuda`) {
		t.Errorf("Open(tpu) set by train.device: %v", err)
	}
	var log logLines
	be, err := Open("auto", Options{Purpose: Training, Logf: log.logf})
	if err != nil || be.Name() != "cpu" {
		t.Fatalf("Open(auto, training): %v %v", be, err)
	}
	log.has(t, "no usable GPU")
	if _, err := Open("cuda", Options{Purpose: Training}); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), missing) {
		t.Errorf("Open(cuda, training) without a driver = %v, want ErrDevice naming %s", err, missing)
	}
	if _, err := Open("tpu", Options{}); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), `"tpu"`) {
		t.Errorf("Open(tpu): %v", err)
	}
	if _, err := Open("cpu", Options{Threads: -1}); !errors.Is(err, ErrDevice) {
		t.Errorf("threads -1: %v", err)
	}
}

// TestOpenWithGPU runs the chooser against the CPU emulator of CUDA (a GPU
// as far as this process can tell; the real GPU under DISTILL_CUDA_TEST=gpu,
// in scripts/gpu-suite.sh): cuda and auto open the CUDA backend for
// inference and for training alike (the training path passed the GPU
// suite).
func TestOpenWithGPU(t *testing.T) {
	cudaemu.Use(t)
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	for _, name := range []string{"cuda", "auto", ""} {
		var log logLines
		be, err := Open(name, Options{Logf: log.logf})
		if err != nil || be.Name() != "cuda" {
			t.Fatalf("Open(%q) with a GPU: %v %v", name, be, err)
		}
		if name != "cuda" {
			log.has(t, "device auto: using")
		}
		if err := Close(be); err != nil {
			t.Fatal(err)
		}
	}
	var log logLines
	be, err := Open("auto", Options{Purpose: Training, Logf: log.logf})
	if err != nil || be.Name() != "cuda" {
		t.Fatalf("Open(auto, training) with a GPU: %v %v", be, err)
	}
	log.has(t, "device auto: using")
	log.has(t, "for training")
	if err := Close(be); err != nil {
		t.Fatal(err)
	}
	log = nil
	be, err = Open("cuda", Options{Purpose: Training, Logf: log.logf})
	if err != nil || be.Name() != "cuda" {
		t.Fatalf("Open(cuda, training) with a GPU: %v %v", be, err)
	}
	if err := Close(be); err != nil {
		t.Fatal(err)
	}

	// A GPU whose backend does not open (no NVRTC): auto falls back to the
	// CPU naming what is missing; cuda fails with it.
	missing := filepath.Join(t.TempDir(), "libnvrtc.so")
	t.Setenv("DISTILL_LIBNVRTC", missing)
	log = nil
	be, err = Open("auto", Options{Logf: log.logf})
	if err != nil || be.Name() != "cpu" {
		t.Fatalf("Open(auto) without NVRTC: %v %v", be, err)
	}
	log.has(t, "does not open")
	log.has(t, missing)
	if _, err := Open("cuda", Options{}); !errors.Is(err, ErrDevice) || !strings.Contains(err.Error(), missing) {
		t.Errorf("Open(cuda) without NVRTC: %v", err)
	}
}

// TestOpenAutoNoDriverOneLine: on a machine with no CUDA driver at all
// (the usual CPU machine), --device auto says so in one short line, not
// the loader's whole search; a driver named but missing (TestOpenWithoutGPU)
// or present and failing is said in full.
func TestOpenAutoNoDriverOneLine(t *testing.T) {
	t.Setenv("DISTILL_LIBCUDA", "")
	if _, err := cuda.Probe(); !errors.Is(err, cuda.ErrNotInstalled) {
		t.Skipf("this machine has a CUDA driver (probe: %v); TestOpenWithoutGPU covers the fallback", err)
	}
	var log logLines
	be, err := Open("auto", Options{Threads: 1, Logf: log.logf})
	if err != nil || be.Name() != "cpu" {
		t.Fatalf("Open(auto): %v %v", be, err)
	}
	if want := "device auto: no GPU driver on this machine (no libcuda.so.1): using the CPU"; len(log) != 1 || log[0] != want {
		t.Errorf("log %q, want the one line %q", log, want)
	}
}
