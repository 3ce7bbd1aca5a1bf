package cuda

/*
static long distill_call_long(void *f) { return ((long (*)(void))f)(); }
*/
import "C"

// emuHostWaits returns how many times the host has waited for the device
// (cuStreamSynchronize, cuCtxSynchronize, cuEventSynchronize) since the
// emulator loaded, and false on a real driver, which does not count them:
// the emulator's distill_emu_host_waits, for the tests that hold a path
// to no host wait (TestMoELoRANoHostWait).
func (b *Backend) emuHostWaits() (int, bool) {
	p, err := b.drv.lib.sym("distill_emu_host_waits")
	if err != nil {
		return 0, false
	}
	return int(C.distill_call_long(p)), true
}
