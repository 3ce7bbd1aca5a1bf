package cuda

/*
#cgo LDFLAGS: -ldl
#include "capi.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unsafe"
)

// A library is one shared object opened with dlopen. Nothing links against
// CUDA at build time: a binary built without any CUDA package runs on the
// CPU, and finds the GPU libraries, if any, only when a GPU is asked for.
type library struct {
	what string // "the CUDA driver", "NVRTC", "cuBLASLt"
	path string // what dlopen accepted
	h    unsafe.Pointer
}

// libSpec says where to look for one library: an environment variable that
// names the file outright, then sonames in order of preference, each tried
// through the dynamic linker's search (LD_LIBRARY_PATH, ld.so.cache) and
// then in the usual CUDA install directories.
type libSpec struct {
	what  string
	env   string
	names []string
	hint  string
}

var (
	specDriver = libSpec{
		what: "the CUDA driver", env: "DISTILL_LIBCUDA", names: []string{"libcuda.so.1"},
		hint: "install the NVIDIA driver (it ships libcuda.so.1), or point DISTILL_LIBCUDA at it",
	}
	specNVRTC = libSpec{
		what: "NVRTC", env: "DISTILL_LIBNVRTC",
		names: []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so"},
		hint:  "install NVRTC (the CUDA toolkit, pip nvidia-cuda-nvrtc, or Debian's libnvrtc11.2 from non-free), or point DISTILL_LIBNVRTC at libnvrtc.so",
	}
	specCublasLt = libSpec{
		what: "cuBLASLt", env: "DISTILL_LIBCUBLASLT",
		names: []string{"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so.11", "libcublasLt.so"},
		hint:  "install cuBLAS (the CUDA toolkit or pip nvidia-cublas), or point DISTILL_LIBCUBLASLT at libcublasLt.so",
	}
)

// cudaDirs are the directories searched after the dynamic linker's own
// search: where the driver and the toolkit usually install.
func cudaDirs() []string {
	var dirs []string
	for _, env := range []string{"CUDA_HOME", "CUDA_PATH"} {
		if d := os.Getenv(env); d != "" {
			dirs = append(dirs, filepath.Join(d, "lib64"), filepath.Join(d, "lib"))
		}
	}
	return append(dirs, "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib",
		"/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib")
}

// ErrNotInstalled is what a library error is (errors.Is) when no file of
// the library was found where the loader looks and no environment
// variable names one: a machine without it, as a machine without a GPU
// has no CUDA driver.
var ErrNotInstalled = errors.New("cuda: library not installed")

type notInstalledError struct{ error }

func (e *notInstalledError) Unwrap() []error { return []error{e.error, ErrNotInstalled} }

// candidates lists the paths openLibrary tries, in order.
func (s libSpec) candidates() []string {
	if p := os.Getenv(s.env); p != "" {
		return []string{p}
	}
	var out []string
	out = append(out, s.names...)
	for _, d := range cudaDirs() {
		for _, n := range s.names {
			out = append(out, filepath.Join(d, n))
		}
	}
	return out
}

// openLibrary dlopens the first candidate that loads. The error names the
// library, every file tried, the loader's last complaint, and what to do.
func openLibrary(s libSpec) (*library, error) {
	cands := s.candidates()
	// Report the first failure, unless a later file was found but failed to
	// load (wrong architecture, missing dependency): that one says more.
	var why string
	for _, p := range cands {
		cs := C.CString(p)
		h := C.distill_dlopen(cs)
		C.free(unsafe.Pointer(cs))
		if h != nil {
			return &library{what: s.what, path: p, h: h}, nil
		}
		if e := C.distill_dlerror(); e != nil {
			msg := C.GoString(e)
			if why == "" || !strings.Contains(msg, "No such file") && strings.Contains(why, "No such file") {
				why = msg
			}
		}
	}
	tried := strings.Join(s.names, ", ")
	p := os.Getenv(s.env)
	if p != "" {
		tried = p + " (from " + s.env + ")"
	}
	err := fmt.Errorf("cuda: cannot load %s: tried %s (%s); %s", s.what, tried, why, s.hint)
	if p == "" && (why == "" || strings.Contains(why, "No such file")) {
		// Not installed at all: a machine without the library, not a
		// broken install.
		err = &notInstalledError{err}
	}
	return nil, err
}

// sym returns the address of one exported function, or an error naming it.
func (l *library) sym(name string) (unsafe.Pointer, error) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	p := C.distill_dlsym(l.h, cs)
	if p == nil {
		return nil, fmt.Errorf("cuda: %s (%s) has no symbol %s: it is too old or not the library it claims to be", l.what, l.path, name)
	}
	return p, nil
}

// bind fills each *unsafe.Pointer of syms with the address of its symbol.
// A name may list fallbacks separated by '|' (a versioned name first); the
// first one found wins. The error names every missing symbol at once.
func (l *library) bind(syms map[string]*unsafe.Pointer) error {
	var missing []string
	for names, dst := range syms {
		var err error
		for _, n := range strings.Split(names, "|") {
			var p unsafe.Pointer
			if p, err = l.sym(n); err == nil {
				*dst = p
				break
			}
		}
		if err != nil {
			missing = append(missing, strings.ReplaceAll(names, "|", " or "))
		}
	}
	if len(missing) > 0 {
		sort.Strings(missing)
		return fmt.Errorf("cuda: %s (%s) lacks %s: it is too old or not the library it claims to be", l.what, l.path, strings.Join(missing, ", "))
	}
	return nil
}

func (l *library) close() {
	if l != nil && l.h != nil {
		C.distill_dlclose(l.h)
		l.h = nil
	}
}
