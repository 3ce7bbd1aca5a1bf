package dist

import "syscall"

// rankProcAttr puts a rank in its own process group (a terminal's Ctrl-C
// reaches it once, forwarded by Launch) and kills it should the launcher
// die without stopping it.
func rankProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
