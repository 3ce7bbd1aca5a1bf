package cuda

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"
)

// nvrtc is the NVRTC runtime compiler, reached through function pointers.
type nvrtc struct {
	lib          *library
	major, minor int

	getErrorString, version, createProgram, destroyProgram, compileProgram unsafe.Pointer
	getLogSize, getLog, getCUBINSize, getCUBIN, getPTXSize, getPTX         unsafe.Pointer
}

// loadNVRTC opens libnvrtc (newest soname first) and binds its entry
// points; a missing library or symbol is an error naming it.
func loadNVRTC() (*nvrtc, error) {
	lib, err := openLibrary(specNVRTC)
	if err != nil {
		return nil, err
	}
	n := &nvrtc{lib: lib}
	if err := lib.bind(map[string]*unsafe.Pointer{
		"nvrtcGetErrorString":    &n.getErrorString,
		"nvrtcVersion":           &n.version,
		"nvrtcCreateProgram":     &n.createProgram,
		"nvrtcDestroyProgram":    &n.destroyProgram,
		"nvrtcCompileProgram":    &n.compileProgram,
		"nvrtcGetProgramLogSize": &n.getLogSize,
		"nvrtcGetProgramLog":     &n.getLog,
		"nvrtcGetCUBINSize":      &n.getCUBINSize,
		"nvrtcGetCUBIN":          &n.getCUBIN,
		"nvrtcGetPTXSize":        &n.getPTXSize,
		"nvrtcGetPTX":            &n.getPTX,
	}); err != nil {
		lib.close()
		return nil, err
	}
	var maj, min C.int
	if r := C.call_nvrtcVersion(n.version, &maj, &min); r != 0 {
		lib.close()
		return nil, fmt.Errorf("cuda: nvrtcVersion (%s) failed with code %d", lib.path, int(r))
	}
	n.major, n.minor = int(maj), int(min)
	return n, nil
}

// Version is "major.minor", e.g. "11.8".
func (n *nvrtc) Version() string { return fmt.Sprintf("%d.%d", n.major, n.minor) }

// supportsArch reports whether this NVRTC can target arch: NVRTC 11.x knows
// sm_90 but not sm_90a (the arch-specific suffix came with 12.0).
func (n *nvrtc) supportsArch(arch string) bool {
	return !strings.HasSuffix(arch, "a") || n.major >= 12
}

func (n *nvrtc) errString(r C.nvrtcResult) string {
	if s := C.call_nvrtcGetErrorString(n.getErrorString, r); s != nil {
		return C.GoString(s)
	}
	return fmt.Sprintf("nvrtc error %d", int(r))
}

// CompileError is NVRTC rejecting a kernel source: the log says why.
type CompileError struct {
	Name, Arch string
	Log        string
}

func (e *CompileError) Error() string {
	return fmt.Sprintf("cuda: NVRTC could not compile %s for %s:\n%s", e.Name, e.Arch, e.Log)
}

// compileOptions are NVRTC's flags for arch: full-precision math (no
// --use_fast_math: the CPU backend is the oracle), line info for
// compute-sanitizer and profilers.
func compileOptions(arch string) []string {
	return []string{"--gpu-architecture=" + arch, "-lineinfo", "--std=c++17"}
}

// compile builds src (named name in diagnostics) to a cubin for arch. It
// returns NVRTC's log too, which holds warnings when it succeeds.
func (n *nvrtc) compile(name, src, arch string) (cubin []byte, log string, err error) {
	return n.compileWith(name, src, arch)
}

// compileWith is compile with extra options after compileOptions' (a
// test's --ptxas-options=-v, whose report lands in the log).
func (n *nvrtc) compileWith(name, src, arch string, extra ...string) (cubin []byte, log string, err error) {
	csrc, cname := C.CString(src), C.CString(name)
	defer C.free(unsafe.Pointer(csrc))
	defer C.free(unsafe.Pointer(cname))
	var prog C.nvrtcProgram
	if r := C.call_nvrtcCreateProgram(n.createProgram, &prog, csrc, cname); r != 0 {
		return nil, "", fmt.Errorf("cuda: nvrtcCreateProgram(%s): %s", name, n.errString(r))
	}
	defer C.call_nvrtcDestroyProgram(n.destroyProgram, &prog)
	opts := append(compileOptions(arch), extra...)
	copts := make([]*C.char, len(opts))
	for i, o := range opts {
		copts[i] = C.CString(o)
		defer C.free(unsafe.Pointer(copts[i]))
	}
	r := C.call_nvrtcCompileProgram(n.compileProgram, prog, C.int(len(opts)), (**C.char)(unsafe.Pointer(&copts[0])))
	log = n.fetch(prog, n.getLogSize, n.getLog)
	log = strings.TrimRight(log, "\x00\n ")
	if r != 0 {
		if log == "" {
			log = n.errString(r)
		}
		return nil, log, &CompileError{Name: name, Arch: arch, Log: log}
	}
	cubin = []byte(n.fetch(prog, n.getCUBINSize, n.getCUBIN))
	if len(cubin) == 0 {
		return nil, log, fmt.Errorf("cuda: NVRTC %s returned an empty cubin for %s (%s)", n.Version(), name, arch)
	}
	return cubin, log, nil
}

// ptx returns the PTX of src for arch (a debugging aid).
func (n *nvrtc) ptx(name, src, arch string) (string, error) {
	csrc, cname := C.CString(src), C.CString(name)
	defer C.free(unsafe.Pointer(csrc))
	defer C.free(unsafe.Pointer(cname))
	var prog C.nvrtcProgram
	if r := C.call_nvrtcCreateProgram(n.createProgram, &prog, csrc, cname); r != 0 {
		return "", fmt.Errorf("cuda: nvrtcCreateProgram(%s): %s", name, n.errString(r))
	}
	defer C.call_nvrtcDestroyProgram(n.destroyProgram, &prog)
	opt := C.CString("--gpu-architecture=compute_" + strings.TrimPrefix(arch, "sm_"))
	defer C.free(unsafe.Pointer(opt))
	if r := C.call_nvrtcCompileProgram(n.compileProgram, prog, 1, &opt); r != 0 {
		return "", &CompileError{Name: name, Arch: arch, Log: n.fetch(prog, n.getLogSize, n.getLog)}
	}
	return strings.TrimRight(n.fetch(prog, n.getPTXSize, n.getPTX), "\x00"), nil
}

// fetch reads one of the program's outputs (log, cubin, PTX) through its
// size and copy functions.
func (n *nvrtc) fetch(prog C.nvrtcProgram, sizeFn, getFn unsafe.Pointer) string {
	var size C.size_t
	if C.call_nvrtcGetSize(sizeFn, prog, &size) != 0 || size == 0 {
		return ""
	}
	buf := make([]byte, int(size))
	if C.call_nvrtcGetBytes(getFn, prog, (*C.char)(unsafe.Pointer(&buf[0]))) != 0 {
		return ""
	}
	return string(buf)
}
