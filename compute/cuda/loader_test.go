package cuda

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// driverPresent reports whether this machine has the NVIDIA driver.
func driverPresent() bool {
	l, err := openLibrary(libSpec{what: "probe", names: specDriver.names})
	if err == nil {
		l.close()
	}
	return err == nil
}

// TestOpenWithoutDriver: on a machine without the NVIDIA driver, Open fails
// at once with an error naming libcuda.so.1 and what to do.
func TestOpenWithoutDriver(t *testing.T) {
	t.Setenv("DISTILL_LIBCUDA", "")
	if driverPresent() {
		t.Skip("this machine has libcuda.so.1; the GPU suite covers Open")
	}
	_, err := Open(Options{})
	if err == nil {
		t.Fatal("Open succeeded without a driver")
	}
	for _, want := range []string{"libcuda.so.1", "the CUDA driver", "DISTILL_LIBCUDA"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// TestLibraryOverride: DISTILL_LIB* names the file outright; a missing
// file is an error naming it and the variable.
func TestLibraryOverride(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "libcuda.so.1")
	t.Setenv("DISTILL_LIBCUDA", missing)
	if c := specDriver.candidates(); len(c) != 1 || c[0] != missing {
		t.Fatalf("candidates with DISTILL_LIBCUDA set: %v, want only %s", c, missing)
	}
	_, err := loadDriver()
	if err == nil || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "DISTILL_LIBCUDA") {
		t.Fatalf("loadDriver with a missing DISTILL_LIBCUDA: %v", err)
	}
	t.Setenv("DISTILL_LIBCUBLASLT", missing)
	if _, err := loadCublasLt(); err == nil || !strings.Contains(err.Error(), "cuBLASLt") {
		t.Fatalf("loadCublasLt with a missing DISTILL_LIBCUBLASLT: %v", err)
	}
}

// TestLibraryCandidates: newest sonames first, each through the dynamic
// linker before the install directories.
func TestLibraryCandidates(t *testing.T) {
	t.Setenv("DISTILL_LIBNVRTC", "")
	t.Setenv("CUDA_HOME", "/opt/cuda-x")
	c := specNVRTC.candidates()
	want := []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so", "/opt/cuda-x/lib64/libnvrtc.so.13"}
	for i, w := range want {
		if c[i] != w {
			t.Fatalf("candidate %d = %s, want %s (all: %v)", i, c[i], w, c[:len(want)])
		}
	}
}

// TestMissingSymbols: a library that loads but is not the driver is an
// error naming it and the symbols it lacks.
func TestMissingSymbols(t *testing.T) {
	t.Setenv("DISTILL_LIBCUDA", "libm.so.6")
	_, err := loadDriver()
	if err == nil {
		t.Fatal("libm.so.6 passed for the CUDA driver")
	}
	for _, want := range []string{"libm.so.6", "cuInit", "cuLaunchKernel", "cuEventElapsedTime_v2 or cuEventElapsedTime"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}

// TestNVRTCCompiles: the installed NVRTC compiles a kernel to an ELF cubin,
// reports warnings in its log, and rejects bad code with a CompileError
// that carries the log.
func TestNVRTCCompiles(t *testing.T) {
	n := requireNVRTC(t)
	if n.major < 11 {
		t.Fatalf("NVRTC %s: want 11.2 or newer", n.Version())
	}
	good := `extern "C" __global__ void k(float *x) { x[threadIdx.x] *= 2; }`
	cubin, log, err := n.compile("good.cu", good, "sm_80")
	if err != nil || !strings.HasPrefix(string(cubin), "\x7fELF") || log != "" {
		t.Fatalf("good kernel: cubin %d bytes, log %q, err %v", len(cubin), log, err)
	}
	warn := `extern "C" __global__ void k(float *x) { int unused; x[0] = 1; }`
	if _, log, err := n.compile("warn.cu", warn, "sm_90"); err != nil || !strings.Contains(log, "warning") {
		t.Fatalf("a kernel with an unused variable: log %q, err %v; want a warning in the log", log, err)
	}
	_, _, err = n.compile("bad.cu", `extern "C" __global__ void k( { }`, "sm_80")
	var ce *CompileError
	if !errors.As(err, &ce) || !strings.Contains(ce.Log, "bad.cu") {
		t.Fatalf("a syntax error: %v; want a CompileError naming bad.cu", err)
	}
	if ptx, err := n.ptx("good.cu", good, "sm_80"); err != nil || !strings.Contains(ptx, ".entry k") {
		t.Fatalf("ptx: %v", err)
	}
}

// TestArch: sm_90a on Hopper only; NVRTC 11 cannot target it.
func TestArch(t *testing.T) {
	for _, c := range []struct {
		major, minor int
		want         string
	}{{8, 0, "sm_80"}, {8, 9, "sm_89"}, {9, 0, "sm_90a"}, {10, 0, "sm_100"}} {
		if got := archFor(c.major, c.minor); got != c.want {
			t.Errorf("archFor(%d,%d) = %s, want %s", c.major, c.minor, got, c.want)
		}
	}
	if (&nvrtc{major: 11, minor: 8}).supportsArch("sm_90a") || !(&nvrtc{major: 12}).supportsArch("sm_90a") {
		t.Error("supportsArch: NVRTC 11.8 must refuse sm_90a and 12.0 accept it")
	}
	if !(&nvrtc{major: 11, minor: 8}).supportsArch("sm_90") {
		t.Error("supportsArch: NVRTC 11.8 must accept sm_90")
	}
}

func TestMain(m *testing.M) {
	// Tests must not write compiled kernels into the user's cache.
	if os.Getenv("DISTILL_KERNEL_CACHE") == "" {
		os.Setenv("DISTILL_KERNEL_CACHE", "off")
	}
	os.Exit(m.Run())
}

// TestNotInstalled: a library none of whose files exists, with no
// DISTILL_LIB* naming one, is ErrNotInstalled (a machine without it);
// a file named by the variable that is missing, or a file that is there
// but does not load, is not: those are broken setups, said in full.
func TestNotInstalled(t *testing.T) {
	spec := libSpec{what: "a test library", env: "DISTILL_LIBTEST_NOPE", names: []string{"libdistill-no-such-library.so.7"}, hint: "none"}
	t.Setenv(spec.env, "")
	if _, err := openLibrary(spec); !errors.Is(err, ErrNotInstalled) || !strings.Contains(err.Error(), "libdistill-no-such-library.so.7") {
		t.Errorf("no file anywhere: %v, want ErrNotInstalled naming the library", err)
	}
	dir := t.TempDir()
	t.Setenv(spec.env, filepath.Join(dir, "missing.so"))
	if _, err := openLibrary(spec); err == nil || errors.Is(err, ErrNotInstalled) {
		t.Errorf("%s names a missing file: %v, want an error that is not ErrNotInstalled", spec.env, err)
	}
	junk := filepath.Join(dir, "junk.so")
	if err := os.WriteFile(junk, []byte("not an ELF file"), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv(spec.env, junk)
	if _, err := openLibrary(spec); err == nil || errors.Is(err, ErrNotInstalled) {
		t.Errorf("%s names a file that does not load: %v, want an error that is not ErrNotInstalled", spec.env, err)
	}
}
