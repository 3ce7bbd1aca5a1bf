package cuda

/*
#include "capi.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// Driver API constants, from the CUDA driver's ABI (cuda.h), declared by
// hand because no header is included.
const (
	attrMaxThreadsPerBlock     = 1
	attrMultiprocessorCount    = 16
	attrL2CacheSize            = 38
	attrComputeMajor           = 75
	attrComputeMinor           = 76
	attrMaxSharedPerBlockOptin = 97

	funcAttrMaxDynamicShared = 8 // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

	mempoolAttrReleaseThreshold = 4 // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
	mempoolAttrReservedMemCur   = 5 // CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT
	mempoolAttrUsedMemCur       = 7 // CU_MEMPOOL_ATTR_USED_MEM_CURRENT
	mempoolAttrUsedMemHigh      = 8 // CU_MEMPOOL_ATTR_USED_MEM_HIGH

	streamNonBlocking = 1 // CU_STREAM_NON_BLOCKING

	memLocationDevice     = 1   // CU_MEM_LOCATION_TYPE_DEVICE
	memAccessReadWrite    = 3   // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
	errPeerAlreadyEnabled = 704 // CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
)

// driver is the CUDA driver API, reached through function pointers.
type driver struct {
	lib *library

	cuInit, cuDriverGetVersion, cuDeviceGetCount, cuDeviceGet, cuDeviceGetName            unsafe.Pointer
	cuDeviceGetAttribute, cuDeviceTotalMem, cuDevicePrimaryCtxRetain                      unsafe.Pointer
	cuDevicePrimaryCtxRelease, cuCtxSetCurrent, cuCtxSynchronize                          unsafe.Pointer
	cuStreamCreate, cuStreamDestroy, cuStreamSynchronize                                  unsafe.Pointer
	cuMemAlloc, cuMemFree, cuMemAllocAsync, cuMemFreeAsync                                unsafe.Pointer
	cuDeviceGetDefaultMemPool, cuMemPoolSetAttribute, cuMemPoolGetAttribute, cuMemGetInfo unsafe.Pointer
	cuMemcpyHtoDAsync, cuMemcpyDtoHAsync, cuMemcpyDtoDAsync, cuMemsetD8Async              unsafe.Pointer
	cuModuleLoadData, cuModuleUnload, cuModuleGetFunction, cuFuncSetAttribute             unsafe.Pointer
	cuLaunchKernel, cuGetErrorName, cuGetErrorString                                      unsafe.Pointer
	cuEventCreate, cuEventRecord, cuEventSynchronize, cuEventElapsedTime, cuEventDestroy  unsafe.Pointer
	cuStreamWaitEvent                                                                     unsafe.Pointer
	cuMemcpyPeerAsync, cuDeviceCanAccessPeer, cuCtxEnablePeerAccess, cuMemPoolSetAccess   unsafe.Pointer
	cuMemAllocHost, cuMemFreeHost                                                         unsafe.Pointer
}

// loadDriver opens libcuda.so.1 and binds every entry point this package
// uses; a missing library or symbol is an error naming it.
func loadDriver() (*driver, error) {
	lib, err := openLibrary(specDriver)
	if err != nil {
		return nil, err
	}
	d := &driver{lib: lib}
	err = lib.bind(map[string]*unsafe.Pointer{
		"cuInit": &d.cuInit, "cuDriverGetVersion": &d.cuDriverGetVersion,
		"cuDeviceGetCount": &d.cuDeviceGetCount, "cuDeviceGet": &d.cuDeviceGet,
		"cuDeviceGetName": &d.cuDeviceGetName, "cuDeviceGetAttribute": &d.cuDeviceGetAttribute,
		"cuDeviceTotalMem_v2":                      &d.cuDeviceTotalMem,
		"cuDevicePrimaryCtxRetain":                 &d.cuDevicePrimaryCtxRetain,
		"cuDevicePrimaryCtxRelease_v2":             &d.cuDevicePrimaryCtxRelease,
		"cuCtxSetCurrent":                          &d.cuCtxSetCurrent,
		"cuCtxSynchronize":                         &d.cuCtxSynchronize,
		"cuStreamCreate":                           &d.cuStreamCreate,
		"cuStreamDestroy_v2":                       &d.cuStreamDestroy,
		"cuStreamSynchronize":                      &d.cuStreamSynchronize,
		"cuMemAlloc_v2":                            &d.cuMemAlloc,
		"cuMemFree_v2":                             &d.cuMemFree,
		"cuMemAllocAsync":                          &d.cuMemAllocAsync,
		"cuMemFreeAsync":                           &d.cuMemFreeAsync,
		"cuDeviceGetDefaultMemPool":                &d.cuDeviceGetDefaultMemPool,
		"cuMemPoolSetAttribute":                    &d.cuMemPoolSetAttribute,
		"cuMemPoolGetAttribute":                    &d.cuMemPoolGetAttribute,
		"cuMemGetInfo_v2":                          &d.cuMemGetInfo,
		"cuMemcpyHtoDAsync_v2":                     &d.cuMemcpyHtoDAsync,
		"cuMemcpyDtoHAsync_v2":                     &d.cuMemcpyDtoHAsync,
		"cuMemcpyDtoDAsync_v2":                     &d.cuMemcpyDtoDAsync,
		"cuMemsetD8Async":                          &d.cuMemsetD8Async,
		"cuModuleLoadData":                         &d.cuModuleLoadData,
		"cuModuleUnload":                           &d.cuModuleUnload,
		"cuModuleGetFunction":                      &d.cuModuleGetFunction,
		"cuFuncSetAttribute":                       &d.cuFuncSetAttribute,
		"cuLaunchKernel":                           &d.cuLaunchKernel,
		"cuGetErrorName":                           &d.cuGetErrorName,
		"cuGetErrorString":                         &d.cuGetErrorString,
		"cuEventCreate":                            &d.cuEventCreate,
		"cuStreamWaitEvent":                        &d.cuStreamWaitEvent,
		"cuEventRecord":                            &d.cuEventRecord,
		"cuEventSynchronize":                       &d.cuEventSynchronize,
		"cuEventElapsedTime_v2|cuEventElapsedTime": &d.cuEventElapsedTime,
		"cuEventDestroy_v2":                        &d.cuEventDestroy,
		"cuMemcpyPeerAsync":                        &d.cuMemcpyPeerAsync,
		"cuDeviceCanAccessPeer":                    &d.cuDeviceCanAccessPeer,
		"cuCtxEnablePeerAccess":                    &d.cuCtxEnablePeerAccess,
		"cuMemPoolSetAccess":                       &d.cuMemPoolSetAccess,
		"cuMemAllocHost_v2":                        &d.cuMemAllocHost,
		"cuMemFreeHost":                            &d.cuMemFreeHost,
	})
	if err != nil {
		lib.close()
		return nil, err
	}
	return d, nil
}

// Error is a failed CUDA driver call: the call, the driver's code, and its
// name and description.
type Error struct {
	Call string
	Code int
	Name string
	Desc string
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s failed: %s (%d): %s", e.Call, e.Name, e.Code, e.Desc)
}

// cudaErrorOutOfMemory is CUDA_ERROR_OUT_OF_MEMORY.
const cudaErrorOutOfMemory = 2

// Unwrap makes an out-of-memory error compute.ErrOutOfMemory for
// errors.Is.
func (e *Error) Unwrap() error {
	if e.Code == cudaErrorOutOfMemory {
		return compute.ErrOutOfMemory
	}
	return nil
}

// check turns a CUresult into an *Error naming the call (nil on success).
func (d *driver) check(call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	e := &Error{Call: call, Code: int(r), Name: "CUDA_ERROR_UNKNOWN", Desc: "unknown error"}
	var s *C.char
	if C.call_cuGetErrorName(d.cuGetErrorName, r, &s) == 0 && s != nil {
		e.Name = C.GoString(s)
	}
	if C.call_cuGetErrorString(d.cuGetErrorString, r, &s) == 0 && s != nil {
		e.Desc = C.GoString(s)
	}
	return e
}

// DeviceInfo describes the GPU the backend runs on.
type DeviceInfo struct {
	Ordinal          int
	Name             string
	Major, Minor     int // compute capability
	SMs              int
	L2Bytes          int
	SharedOptinBytes int // the most dynamic shared memory a block may opt in to
	TotalMem         int64
	DriverVersion    int // e.g. 13000 for 13.0
}

// Arch is the NVRTC target for the device: sm_90a on Hopper (so wgmma and
// setmaxnreg are available), sm_XY elsewhere.
func (i DeviceInfo) Arch() string { return archFor(i.Major, i.Minor) }

func archFor(major, minor int) string {
	a := fmt.Sprintf("sm_%d%d", major, minor)
	if major == 9 && minor == 0 {
		a += "a"
	}
	return a
}

func (d *driver) deviceInfo(ord int) (DeviceInfo, error) {
	info := DeviceInfo{Ordinal: ord}
	var dev C.CUdevice
	if err := d.check("cuDeviceGet", C.call_cuDeviceGet(d.cuDeviceGet, &dev, C.int(ord))); err != nil {
		return info, err
	}
	var name [256]C.char
	if err := d.check("cuDeviceGetName", C.call_cuDeviceGetName(d.cuDeviceGetName, &name[0], 256, dev)); err != nil {
		return info, err
	}
	info.Name = C.GoString(&name[0])
	for _, a := range []struct {
		attr int
		dst  *int
	}{{attrComputeMajor, &info.Major}, {attrComputeMinor, &info.Minor}, {attrMultiprocessorCount, &info.SMs},
		{attrL2CacheSize, &info.L2Bytes}, {attrMaxSharedPerBlockOptin, &info.SharedOptinBytes}} {
		var v C.int
		if err := d.check("cuDeviceGetAttribute", C.call_cuDeviceGetAttribute(d.cuDeviceGetAttribute, &v, C.int(a.attr), dev)); err != nil {
			return info, err
		}
		*a.dst = int(v)
	}
	var total C.size_t
	if err := d.check("cuDeviceTotalMem", C.call_cuDeviceTotalMem(d.cuDeviceTotalMem, &total, dev)); err != nil {
		return info, err
	}
	info.TotalMem = int64(total)
	var v C.int
	if err := d.check("cuDriverGetVersion", C.call_cuDriverGetVersion(d.cuDriverGetVersion, &v)); err != nil {
		return info, err
	}
	info.DriverVersion = int(v)
	return info, nil
}
