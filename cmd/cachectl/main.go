// Command cachectl is the operator's tool for the teacher top-k cache:
// filling it from a teacher, checking it, reading it, and debugging the data
// pipeline that feeds it. Each subcommand lives in its own file and registers
// itself in init.
package main

import (
	"os"

	"distill/compute/device"
	"distill/internal/cli"
)

// commands holds the subcommands; each registers itself from its own file.
var commands = cli.New("cachectl")

func main() {
	device.EnsureCPUCore(os.Stderr)
	commands.Main(os.Args[1:])
}
